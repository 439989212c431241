"""The console the run's processes share: each line whole, and none that says nothing about the user's run.

Whole lines. Under ``PYTHONUNBUFFERED=1`` (common in cluster job scripts, and set on CI machines) Python writes stdout and
stderr through (``write_through``): ``print(line)`` is two writes, the line and then its newline. Ranks
printing at the same moment into one terminal, pipe or Slurm log then glue their lines together ("...step 4lit-dist:
error: ...", then an empty line), so a rank's "lit-dist: error:" line is no longer a line of its own. Measured on
CI: a full disk's two identical lines came out as one. Line buffering without write-through keeps the output
unbuffered in effect (each line is written as it ends) while making each line one write.

Quiet Lightning. Lightning prints messages that say nothing about the run (advertisements, warnings about its own
calls, a FLOPs column it never measured); ``quiet_lightning`` drops them, and prints lit-dist's own warnings as the
one line they are.
"""

import logging
import re
import sys
import warnings


def whole_lines() -> None:
    """Make this process write each line of stdout and stderr in one write (see the module's docstring). Leaves
    alone a stream that is not the process's own (a test's capture, a wrapper around it)."""
    for stream, own in ((sys.stdout, sys.__stdout__), (sys.stderr, sys.__stderr__)):
        if stream is not None and stream is own and getattr(stream, "write_through", False):
            stream.reconfigure(write_through=False, line_buffering=True)


def quiet_lightning() -> None:
    """Drop Lightning's messages that say nothing about the user's run (called once, before anything is built)."""
    # Advertisements for hosted services, printed on every run.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(lambda record: not str(record.msg).startswith("💡 Tip"))
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecates; nothing the user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # lit-dist passes its own argv (without the subcommand) to LightningCLI on purpose.
    warnings.filterwarnings("ignore", message=r"LightningCLI's args parameter is intended")
    # LitModel all-reduces its evaluation sums itself, so the values it logs are already global.
    warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting")
    # Lightning logs every log_every_n_steps optimizer steps of the whole run, across epochs: an epoch shorter than
    # that (a DreamBooth set of 20 images) loses no logs, whatever this warning suggests.
    warnings.filterwarnings("ignore", message=r"The number of training batches \(\d+\) is smaller than the logging")
    from lit_dist.runtime.launch import in_slurm_job

    if not in_slurm_job():
        # Printed wherever Slurm's client tools are installed, on every run; outside a Slurm job there is
        # nothing to prepend srun to. Inside an allocation (salloc) the hint stays: there it may be a mistake.
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    logging.getLogger("lightning.pytorch.callbacks.model_summary").addFilter(_drop_unmeasured_flops)
    if not getattr(warnings.formatwarning, "lit_dist", False):
        warnings.formatwarning = _one_line_for_lit_dist(warnings.formatwarning)


def _one_line_for_lit_dist(format_warning):
    """``warnings.formatwarning`` that prints lit-dist's own warnings (messages starting "lit-dist:") as
    the one line they are, like lit-dist's other messages, without Python's file, line, category and the
    source line of the call; every other warning as ``format_warning`` does (Lightning's own format)."""

    def formatted(message, category, filename, lineno, line=None):
        if str(message).startswith("lit-dist:"):
            return f"{message}\n"
        return format_warning(message, category, filename, lineno, line)

    formatted.lit_dist = True
    return formatted


def _drop_unmeasured_flops(record: logging.LogRecord) -> bool:
    """The model summary without its FLOPs column and "Total Flops" line when they were never measured.

    Lightning counts FLOPs only by running ``model.example_input_array`` through the model; LitModel
    sets none (its input size changes from bucket to bucket), so every count would print as 0.
    """
    if isinstance(record.msg, str) and not record.args:
        record.msg = without_unmeasured_flops(record.msg)
    return True


def without_unmeasured_flops(summary: str) -> str:
    """``summary`` (Lightning's model summary table) without FLOPs when its total is 0; else unchanged."""
    lines = summary.split("\n")
    if not lines or not re.fullmatch(r"0\s+Total Flops", lines[-1].strip()):
        return summary
    lines = lines[:-1]
    header = next((line.split(" | ") for line in lines if " | " in line), [])
    if "FLOPs" not in [cell.strip() for cell in header]:
        return "\n".join(lines)
    column = [cell.strip() for cell in header].index("FLOPs")
    width = len(header[column]) + 3  # the cell and its " | "
    out = []
    for line in lines:
        cells = line.split(" | ")
        if len(cells) == len(header):
            line = " | ".join(cells[:column] + cells[column + 1:]).rstrip()
        elif line and set(line) == {"-"}:
            line = line[:-width]
        out.append(line)
    return "\n".join(out)
