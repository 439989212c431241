"""Pieces shared by the benchmarks: in-memory data, a step timer, the machine description, the result line."""

import contextlib
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
import uuid

import torch
from lightning.pytorch import Callback, LightningDataModule

from lit_dist.runtime.processes import alive, tagged


class InMemoryData(LightningDataModule):
    """Random uint8-range images and labels held in memory, as dict batches like BucketDataModule's."""

    def __init__(self, num_samples: int = 4096, size: int = 32, num_classes: int = 4, batch_size_per_device: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(num_samples, 3, size, size, generator=g)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=g)
        self.batch_size_per_device = batch_size_per_device

    def train_dataloader(self):
        dataset = [{"image": self.images[i], "label": self.labels[i]} for i in range(len(self.labels))]
        # Pinned on GPUs, as BucketDataModule's: a copy from pageable memory makes the host wait for the device.
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size_per_device, shuffle=True, num_workers=0,
                                           pin_memory=torch.cuda.is_available())


class StepTimer(Callback):
    """Prints one ``BENCH {...}`` line: wall time of the first step and steps/s after a warm-up."""

    def __init__(self, warmup_steps: int = 20):
        super().__init__()
        self.warmup_steps = warmup_steps
        self.first_step_at = None
        self.start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if trainer.global_step == self.warmup_steps:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if self.start is None:
            raise RuntimeError(f"StepTimer: the run ended after step {trainer.global_step}, within its "
                               f"{self.warmup_steps} warm-up steps: nothing was timed. Run more steps or lower "
                               "--trainer.callbacks.warmup_steps")
        steps = trainer.global_step - self.warmup_steps
        elapsed = time.perf_counter() - self.start
        if trainer.is_global_zero:
            print("BENCH " + json.dumps({"first_step_at": self.first_step_at, "steps_per_s": steps / elapsed}), flush=True)


class TimedSaves(Callback):
    """Every ``every`` optimizer steps, after a first interval that warms up, one save of the next kind in ``kinds``
    (``save(trainer, kind)``: a benchmark's own); meanwhile the time of each step without a save, kept apart by
    whether the save before it was asynchronous (``step_s``: what a background write costs the steps). Training
    stops once every kind has had its turn."""

    def __init__(self, kinds: list[str], every: int):
        self.kinds, self.every = list(kinds), every
        self.step_s = {"after_async": [], "after_other": []}
        self._last_kind = None
        self._step_start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self._last_kind is not None and step % self.every:
            key = "after_async" if self._last_kind == "async" else "after_other"
            self.step_s[key].append(time.perf_counter() - self._step_start)
        if step % self.every or step < self.every:  # the first interval warms up
            return
        if not self.kinds:
            trainer.should_stop = True
            return
        kind = self.kinds.pop(0)
        self.save(trainer, kind)
        self._last_kind = kind

    def save(self, trainer, kind: str) -> None:
        raise NotImplementedError


def machine() -> str:
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every benchmark's --short: tests/process/test_benchmarks.py runs each so, since a benchmark that nothing runs breaks
# unseen. Each script shrinks its own sizes after parse_args; the targets are for the full runs.
SHORT_HELP = "a quick run that checks the benchmark works; its figures mean nothing"


# Each command's limit: a hung run is one error with its processes' stacks, not a benchmark that never ends.
# tests/process/test_benchmarks.py lowers it for the short runs.
COMMAND_TIMEOUT_S = float(os.environ.get("LIT_DIST_BENCH_COMMAND_TIMEOUT_S", 7200))
TAG_ENV = "LIT_DIST_BENCH_TAG"  # in the environment of every process a benchmark command starts


WARM_ENV = "LIT_DIST_BENCH_WARM"  # "1": commands forked from one warm process (tests/process/test_benchmarks.py)


def lit_dist(*args: str) -> subprocess.CompletedProcess:
    """``lit-dist ARGS`` from the repository root (a command whose figures are not read, e.g. cache, export, sample);
    a RuntimeError with the ends of its output if it fails."""
    return command([sys.executable, "-m", "lit_dist", *args])


def run_bench(cmd: list[str], env: dict | None = None) -> dict:
    """Run a benchmark command from the repository root (``env``: variables added to this one's): its ``BENCH``
    lines merged, and ``to_first_step_s`` where the run reports its first step. RuntimeError with its output if it
    fails or outlives ``COMMAND_TIMEOUT_S``."""
    started = time.time()
    result = parse_bench(command(cmd, env).stdout)
    if "first_step_at" in result:
        result["to_first_step_s"] = result["first_step_at"] - started
    return result


def command(cmd: list[str], env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``cmd`` run from the repository root with this process's environment and ``env``, its output captured. A
    RuntimeError with the ends of its output if it fails (unless not ``check``), with its processes' stacks if it
    outlives ``COMMAND_TIMEOUT_S``.

    With ``LIT_DIST_BENCH_WARM=1`` (the short runs of tests/process/test_benchmarks.py) a ``python -m`` command is
    forked from one warm process of this benchmark's (tests/helpers/zygote.py), without the 4 s of import a new
    interpreter spends: a short run starts a dozen such commands, and its figures are not read."""
    # Every process the command starts carries the tag, whatever its session: torchrun starts each worker in a
    # session of its own, where a signal to the command's group does not reach it.
    tag = uuid.uuid4().hex
    env = {**_command_env(), **(env or {}), TAG_ENV: tag}
    warm = _warm_process()
    module = _module_of(cmd)
    if warm is not None and module is not None and warm.can_run(env, None):
        pid, code, stdout, stderr, hung = warm.run(module[0], module[1], env, ROOT, COMMAND_TIMEOUT_S,
                                                   lambda pid, sig: _signal_all(pid, tag, sig))
        if hung:
            _signal_all(pid, tag, signal.SIGKILL)
            _wait_until_gone(tag)
    else:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        hung = False
        try:
            stdout, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hung = True
            _abort_one_by_one(tagged(TAG_ENV, tag))
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", "(none: its processes did not end within 30 s of SIGABRT)"
            _signal(tagged(TAG_ENV, tag), signal.SIGKILL)
            proc.wait()
            _wait_until_gone(tag)
        code = proc.returncode
    if hung:
        raise RuntimeError(f"{' '.join(cmd)} hung for {COMMAND_TIMEOUT_S:.0f} s; its stacks:\n{stderr[-12000:]}")
    if code and check:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def _command_env() -> dict:
    """This process's environment as a command gets it: faulthandler on, the repository importable."""
    return {**os.environ, "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def _module_of(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of ``python -m MODULE ...`` or ``lit-dist ...``; None for another command (torchrun)."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return cmd[2], list(cmd[3:])
    if cmd and os.path.basename(cmd[0]) == "lit-dist":
        return "lit_dist", list(cmd[1:])
    return None


_WARM: list = []  # this benchmark's warm process, once asked for; None where there is none


def _warm_process():
    if not _WARM:
        warm = None
        if os.environ.get(WARM_ENV) == "1":
            import atexit

            from tests.helpers.zygote import Zygote

            # A fork of this process where it can be (a short run forked from the tests' warm process), else a new
            # one; none at all: commands start as new interpreters.
            for fork in (True, False):
                with contextlib.suppress(OSError):
                    warm = Zygote(_command_env(), fork=fork)
                    atexit.register(warm.close)
                    break
        _WARM.append(warm)
    return _WARM[0]


def _signal_all(sid: int, tag: str, sig: int) -> None:
    """``sig`` to every process of a forked command: its session (``sid``), and whatever carries its tag elsewhere;
    one by one with SIGABRT, so that each writes its stacks whole."""
    import psutil

    pids = {p.pid for p in psutil.process_iter() if _session_of(p.pid) == sid} | set(tagged(TAG_ENV, tag))
    if sig == signal.SIGABRT:
        _abort_one_by_one(sorted(pids))
    else:
        _signal(pids, sig)


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _abort_one_by_one(pids: list[int], wait_s: float = 2.0) -> None:
    """SIGABRT each process, then wait (up to ``wait_s``) for it to end: with PYTHONFAULTHANDLER each writes its
    stacks, whole, not interleaved with another's in the pipe they share."""
    for pid in pids:
        _signal([pid], signal.SIGABRT)
        deadline = time.monotonic() + wait_s
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, sig)


def _wait_until_gone(tag: str, timeout_s: float = 10.0) -> None:
    """Wait (up to ``timeout_s``) until no live process carries ``tag``: a process that got SIGKILL is still
    exiting for a moment after its pipes closed (zombies, waiting for their reaper, count as gone)."""
    deadline = time.monotonic() + timeout_s
    while tagged(TAG_ENV, tag) and time.monotonic() < deadline:
        time.sleep(0.05)


def parse_bench(output: str) -> dict:
    """The ``BENCH {...}`` lines of a run's output, merged into one dict."""
    found = [json.loads(line[len("BENCH "):]) for line in output.splitlines() if line.startswith("BENCH ")]
    if not found:
        raise RuntimeError("no BENCH line in output:\n" + output[-3000:])
    return {k: v for d in found for k, v in d.items()}


class PeakMemory(Callback):
    """Prints ``BENCH {"peak_bytes": ...}``: the most memory any rank held during training.

    On GPUs what the CUDA caching allocator handed out (torch.cuda.max_memory_allocated);
    on CPU the process's peak resident size.
    """

    def on_train_start(self, trainer, pl_module):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module):
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak = torch.tensor([peak], dtype=torch.float64, device=pl_module.device)
        if torch.distributed.is_initialized():  # every rank reaches this: on_train_end runs on all
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        if trainer.is_global_zero:
            print("BENCH " + json.dumps({"peak_bytes": int(peak.item())}), flush=True)


def _tensors(obj, depth: int = 0):
    """The tensors in ``obj`` and the lists, tuples and dicts it holds (a few levels deep), and their ``.grad``."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif depth < 4 and isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1)
    elif depth < 4 and isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors(value, depth + 1)


class StateMemory(Callback):
    """Prints ``BENCH {...}`` with this rank's bytes of parameters, gradients, optimizer state and (DeepSpeed ZeRO)
    the optimizer's own copies and buffers.

    Counted from the tensors each rank holds (local shards under FSDP, ``ds_tensor`` partitions under ZeRO-3, the
    ZeRO optimizer's fp32 partitions and gradient partitions), each storage once, just before the optimizer step
    (every gradient exists then, and from the second step Adam's moments), the largest over the steps. DDP's
    gradient buckets are not reachable from the model or the optimizer and are not counted: DDP is flattered.
    """

    def __init__(self):
        super().__init__()
        self.peak = {"params": 0, "grads": 0, "optimizer": 0, "zero_buffers": 0, "total": 0}

    @staticmethod
    def _local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        seen: set[int] = set()

        def size(tensors) -> int:
            total = 0
            for t in tensors:
                storage = self._local(t).untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        params = list(pl_module.parameters())
        sizes = {"params": size([p for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")])}
        zero = [opt for opt in trainer.optimizers if type(opt).__module__.startswith("deepspeed")]
        inner = [getattr(opt, "optimizer", opt) for opt in trainer.optimizers]
        grads = [p.grad for p in params if p.grad is not None]
        for opt in zero:  # ZeRO's gradient partitions and buckets
            grads += [t for name, value in vars(opt).items() if "grad" in name and name != "optimizer"
                      for t in _tensors(value)]
        sizes["grads"] = size(grads)
        sizes["optimizer"] = size(t for opt in inner for state in opt.state.values() for t in _tensors(state))
        # ZeRO's fp32 partitions (master weights), flat buffers: what the ZeRO optimizer holds besides the above.
        sizes["zero_buffers"] = size(t for opt in zero for name, value in vars(opt).items() if name != "optimizer"
                                     for t in _tensors(value))
        sizes["total"] = sum(sizes.values())
        if sizes["total"] > self.peak["total"]:
            self.peak = sizes

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())  # the global counts
            print("BENCH " + json.dumps({**self.peak, "num_params": params}), flush=True)


def s3_credentials() -> None:
    """The local S3 server's credentials in the environment, where unset. Before any loader worker starts when
    they read from it: workers fork from a server that keeps the environment it started with."""
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def local_s3():
    """A local S3 server (moto's server mode, as the tests use) for the block: yields the storage options that reach
    it (its credentials set in the environment where unset)."""
    import socket

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                requests.get(endpoint, timeout=10)  # its first answer imports its services: seconds on a busy machine
                break
            except requests.ConnectionError:  # not listening yet
                time.sleep(0.1)
        s3_credentials()
        yield {"client_kwargs": {"endpoint_url": endpoint}}
    finally:
        server.terminate()
        server.wait(10)


def checks(figures: dict, targets: dict) -> dict:
    """{name: whether it met its target} for ``targets`` ({name: (">=" or "<=", bound)}) of ``figures``; a figure
    the run did not measure (absent or None) is left out."""
    return {name: (value >= bound if op == ">=" else value <= bound)
            for name, (op, bound) in targets.items() if (value := figures.get(name)) is not None}


def result_line(benchmark: str, ratio, target, met, **extra) -> None:
    """Print the line every benchmark ends its output with: one JSON object, flushed.

    ``{"benchmark": ..., "ratio": ..., "target": ..., "met": ..., **extra}``: the primary ratio, its
    target (a number, or a short string such as ``"<= 0.2"``), whether it was met, then any other
    figures. Call it last, after every other print.
    """
    print(json.dumps({"benchmark": benchmark, "ratio": ratio, "target": target, "met": met, **extra}), flush=True)


class EMAMemory(Callback):
    """Prints ``BENCH {"ema_bytes": ...}``: the bytes of model.ema's average that rank 0 holds (its shards under
    FSDP2, a whole copy under DDP)."""

    def on_train_end(self, trainer, pl_module):
        ema = pl_module.ema
        held = 0
        for name in ema.names:
            buffer = ema.average.get_buffer(name)
            local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
            held += local.numel() * local.element_size()
        if trainer.is_global_zero:
            print("BENCH " + json.dumps({"ema_bytes": held}), flush=True)


class SamplingTime(Callback):
    """Prints ``BENCH {"sampling_s": [...], "adherence": [...]}`` on rank 0: what each ``samples.written`` event of
    the run said (lit_dist.callbacks.samples), from the run control's publisher."""

    def __init__(self):
        super().__init__()
        self.seconds, self.adherence = [], []

    def connect(self, control) -> None:
        control.subscribe(self)

    def send(self, event) -> None:
        if event.type == "samples.written" and self.seconds is not None:
            self.seconds.append(event.data["seconds"])
            if "adherence" in event.data:
                self.adherence.append(event.data["adherence"])

    def flush(self, timeout_s=None) -> bool:
        return True

    def teardown(self, trainer, pl_module, stage) -> None:
        if trainer.is_global_zero and self.seconds is not None:  # once: teardown may come more than once
            print("BENCH " + json.dumps({"sampling_s": self.seconds, "adherence": self.adherence}), flush=True)
            self.seconds = None
