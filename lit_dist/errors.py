"""Exit codes and the errors that carry them.

Every code is documented in docs/exit-codes.md. The GPU-fault,
preemption, hang, straggler, preflight, process-died, storage-full and store-unreachable codes sit outside 64-78 (sysexits), 126-165 (shell and signals) and
255, so an orchestrator can tell them from everything else.
"""

import re
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # an unexpected error: a bug, or something not classified below
    CONFIG_ERROR = 2  # the configuration or command line is wrong
    DATA_ERROR = 3  # metadata or images are missing or unusable
    GPU_FAULT = 10  # the GPU of some rank is faulty: drain the node, do not retry there
    PREEMPTED = 11  # saved (and requeued under Slurm) after a preemption signal: not a failure
    HUNG = 12  # a rank made no progress for the watchdog's timeout: stacks dumped, job requeued under Slurm
    STRAGGLER = 13  # saved and requeued without the node of a persistently slow rank (straggler.exclude_node)
    PREFLIGHT = 14  # the preflight measured a rank or node below preflight.min_fraction of the median
    PROCESS_DIED = 15  # a rank or a data loader worker died (a signal, e.g. the out-of-memory killer): resume the run
    STORAGE_FULL = 16  # local storage is full: free space or move the run dir, then resume
    STORE_UNREACHABLE = 17  # the object store did not answer for data. or checkpoint.outage_deadline_s: retry later, as is


class LitDistError(Exception):
    """A user-facing error: printed as one message, without a traceback."""

    exit_code: ExitCode = ExitCode.FAILURE

    def __init__(self, message: str = "", *args):
        super().__init__(_from_worker(message, type(self).__name__), *args)


def _from_worker(message, name: str):
    """The message of an error raised in a DataLoader worker: PyTorch re-raises it in the training process as
    ``type(exc)(text)``, the text "Caught X in DataLoader worker process N." followed by the worker's traceback,
    whose last lines are "module.X: message"."""
    marker = f"{name}: "
    if isinstance(message, str) and message.startswith("Caught ") and "DataLoader worker" in message and marker in message:
        return message.rsplit(marker, 1)[1].strip()
    return message


class ConfigError(LitDistError, ValueError):
    """A configuration value is wrong. The message names the field, the value and the fix."""

    exit_code = ExitCode.CONFIG_ERROR

    @classmethod
    def collect(cls, problems: list[str]) -> None:
        """Raise one error listing every problem found, or return if there is none."""
        if len(problems) == 1:
            raise cls(problems[0])
        if problems:
            raise cls(f"{len(problems)} problems in the configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class CheckpointError(LitDistError):
    """A checkpoint cannot be written or none of the existing ones can be loaded."""

    exit_code = ExitCode.FAILURE


class StorageFull(CheckpointError):
    """What the run writes did not fit (a checkpoint, mostly): no space, inodes or quota left where it is written."""

    exit_code = ExitCode.STORAGE_FULL


class Preempted(LitDistError):
    """The run was preempted: a checkpoint was saved (and under Slurm the job requeued)."""

    exit_code = ExitCode.PREEMPTED


class StragglerStop(LitDistError):
    """A persistently slow rank's node was excluded: saved, requeued without it (straggler.exclude_node)."""

    exit_code = ExitCode.STRAGGLER


class DataError(LitDistError):
    """The dataset cannot be used as configured."""

    exit_code = ExitCode.DATA_ERROR


_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^Subtypes:|^Errors:|Expected a <class 'NoneType'>|^Given value type:"
)
_DEFAULT_CLASSES = re.compile(r"^Problem with given class_path 'lit_dist\.(LitModel|module\.LitModel|data\.datamodule\.BucketDataModule)':$")


def explain_parse_error(message: str) -> str:
    """Condense a jsonargparse error (nested, with union noise) into ``field: problem``."""
    keys: list[str] = []
    details: list[str] = []
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or _NOISE.search(line) or _DEFAULT_CLASSES.match(line):
            continue
        if key := re.fullmatch(r'Parser key "([^"]+)":?\s*(.*)', line):
            keys.append(key.group(1))
            if key.group(2):
                details.append(key.group(2))
        elif nested := re.fullmatch(r"Given value: NestedArg\(key='([^']*)', val=(.*)\)", line):
            keys.append(nested.group(1))
            details.append(f"given value: {nested.group(2)}")
        else:
            details.append(line.removesuffix(":") if line.endswith("':") else line)
    path: list[str] = []
    for key in keys:  # nested keys repeat their parent's name: ["model", "net", "net.class_path"]
        if path and key.startswith(path[-1] + "."):
            path[-1] = key
        elif not path or key != path[-1]:
            path.append(key)
    field = ".".join(path)
    if any("Got value" in d for d in details):
        details = [d for d in details if not d.startswith("given value")]
    problem = "; ".join(details) or message
    return f"{field}: {problem}" if field else problem
