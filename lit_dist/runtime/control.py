"""Run control: the one place where run-wide decisions are taken, and the one event publisher.

Components (preemption, the GPU circuit breaker, checkpointing's timer, the bad-sample count of the
data module, and what comes next: step timings, heartbeats) never call or look each other up. Each
is handed the run's ``RunControl`` once (``connect(control)``, at setup) and then only talks to it:

- **Facts.** ``share(name, reduce, read)`` names a number this rank knows (a signal arrived: 1; bad
  samples so far: 12). Every ``sync_every_n_steps`` optimizer steps the owner reads every fact and
  sends them all in one small all-gather, launched asynchronously; it reads the result at the next
  step boundary, so the exchange adds no host-device synchronisation to a step (on a GPU it waits,
  one step later, only for the exchange itself, long finished by then). On one process there is no
  collective and facts are agreed at every step.
- **Decisions.** ``on_agreed(listener)``: a listener gets the agreed view (``Agreed``: each fact
  reduced over ranks, and every rank's value) at the same step on every rank, and asks for actions:
  ``request_save(reason)``, ``request_stop(Stop(...))``.
- **Actions.** The owner carries them out at that step boundary, on every rank, in this order:
  1. save a checkpoint if a save or a stop asked for one (and a saver is connected),
  2. the stop's ``announce`` (e.g. rank 0 requeues the Slurm job and publishes ``run.preempted``),
  3. flush the events, wait for every rank, and raise the stop's error (its exit code ends the run).
  Several stops at one step: the most severe wins (``STOP_PRIORITY``: GPU fault, data error, failure, storage
  full, straggler, then preemption).
- **Events.** ``publish(event)`` hands an event to every subscriber (the webhook notifier, the
  console) at once; it never blocks. Run-level events (``run.started``, ``run.progress``,
  ``validation.finished``, ``run.finished``, ``run.failed``) are published by the owner from rank 0.

Configured by the CLI's ``control`` group::

    control:
      sync_every_n_steps: 5     # a stop happens at most 6 optimizer steps after its cause
"""

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal, Protocol

import numpy as np
import torch
from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, ExitCode, LitDistError

log = logging.getLogger(__name__)

Reduce = Literal["max", "sum"]
# Which stop wins when several are asked for at one step: the more severe first.
# A full disk before a preemption: the preempted run's save and requeue would meet the same full disk.
STOP_PRIORITY = (ExitCode.GPU_FAULT, ExitCode.DATA_ERROR, ExitCode.FAILURE, ExitCode.STORAGE_FULL, ExitCode.STRAGGLER,
                 ExitCode.PREEMPTED)


@dataclass(frozen=True)
class Event:
    """One run event (docs/webhooks.md, "Event schema"); sinks add run id, host, rank and time."""

    type: str
    severity: Literal["info", "warning", "error", "critical"]
    title: str
    message: str = ""
    data: dict = field(default_factory=dict)
    timestamp: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())


class Subscriber(Protocol):
    def send(self, event: Event) -> None: ...  # must not block

    def flush(self, timeout_s: float | None = None) -> bool: ...


@dataclass
class Stop:
    """A request to end the run at this step on every rank.

    Args:
        error: Raised on every rank after the save and the announcement, its exit code ending the process;
            or a function of the saved checkpoint's path (None without one) that makes it.
        save: Checkpoint reason to save under first (None: no save).
        announce: Called on every rank after the save as ``announce(trainer, path)``.
    """

    error: LitDistError | Callable[[str | None], LitDistError]
    save: str | None = None
    announce: Callable[[object, str | None], None] | None = None

    def make_error(self, saved: str | None) -> LitDistError:
        return self.error if isinstance(self.error, LitDistError) else self.error(saved)

    @property
    def rank(self) -> int:
        """Position in STOP_PRIORITY (lower wins)."""
        code = self.make_error(None).exit_code
        return STOP_PRIORITY.index(code) if code in STOP_PRIORITY else len(STOP_PRIORITY)


class Agreed:
    """The facts of one exchange, the same on every rank."""

    def __init__(self, step: int, layout: dict[str, tuple[int, str]], table: torch.Tensor | np.ndarray):
        self.step = step  # the optimizer step at which the facts were read
        self._layout = layout  # name -> (column, reduce)
        # [world, facts], float64, on the host. NumPy: the listeners read it at every step of a one-process run,
        # where a torch op per read cost ~0.2 ms a step in all (benchmarks.profile_step).
        self._table = table.numpy() if isinstance(table, torch.Tensor) else table

    def __getitem__(self, name: str) -> float:
        """The fact reduced over ranks (max or sum, as shared)."""
        column, reduce = self._layout[name]
        values = self._table[:, column]
        return float(values.max() if reduce == "max" else values.sum())

    def per_rank(self, name: str) -> list[float]:
        """Every rank's value of the fact, in rank order."""
        return self._table[:, self._layout[name][0]].tolist()


class RunControl(Callback):
    """Collects per-rank facts, agrees on them in one exchange per window, carries out requested actions
    at a step boundary on every rank, and publishes events; see the module docstring."""

    def __init__(self, sync_every_n_steps: int = 5, progress_every_s: float = 600.0):
        """Run control settings.

        Args:
            sync_every_n_steps: Optimizer steps between the exchanges of per-rank facts (one small asynchronous all-gather each); a stop, preemption included, happens at most this many steps + 1 after its cause.
            progress_every_s: At most one run.progress event (step, epoch, train metrics) per this many seconds.
        """
        problems = []
        if sync_every_n_steps < 1:
            problems.append(f"control.sync_every_n_steps: {sync_every_n_steps} must be at least 1")
        if progress_every_s <= 0:
            problems.append(f"control.progress_every_s: {progress_every_s} must be positive")
        ConfigError.collect(problems)
        self.sync_every_n_steps = sync_every_n_steps
        self.progress_every_s = progress_every_s
        self._last_progress = float("-inf")
        self._facts: dict[str, tuple[str, Callable[[], float]]] = {}
        self._listeners: list[Callable[[object, Agreed], None]] = []
        self._epoch_hooks: list[Callable[[object], None]] = []
        self._end_hooks: list[Callable[[object], None]] = []
        self._summaries: dict[str, Callable[[], dict]] = {}  # name -> read(), sent with run.finished
        self._subscribers: list[Subscriber] = []
        self._saver = None
        self._saves: list[str] = []
        self._stops: list[Stop] = []
        self._inflight = None
        self._last_step = -1
        self._connected = False
        self._where: list[dict] = []  # every rank's host and Slurm node, from the start of training

    def __repr__(self) -> str:
        return f"RunControl(sync_every_n_steps={self.sync_every_n_steps})"

    # -- what components call -----------------------------------------------------------------

    def share(self, name: str, reduce: Reduce, read: Callable[[], float]) -> None:
        """Share a per-rank fact: ``read()`` is called at each exchange; every rank must share the same names."""
        if reduce not in ("max", "sum"):
            raise ValueError(f"reduce must be 'max' or 'sum', not {reduce!r}")
        self._facts[name] = (reduce, read)

    def on_agreed(self, listener: Callable[[object, Agreed], None]) -> None:
        """Call ``listener(trainer, agreed)`` after each exchange, at the same step on every rank."""
        self._listeners.append(listener)

    def at_epoch_start(self, hook: Callable[[object], None]) -> None:
        """Call ``hook(trainer)`` at the start of every training epoch, on every rank (collectives allowed)."""
        self._epoch_hooks.append(hook)

    def at_train_end(self, hook: Callable[[object], None]) -> None:
        """Call ``hook(trainer)`` when training ends, on every rank (collectives allowed)."""
        self._end_hooks.append(hook)

    def summarize(self, name: str, read: Callable[[], dict]) -> None:
        """Send ``read()`` under ``name`` with ``run.finished`` (rank 0), e.g. the goodput ledger."""
        self._summaries[name] = read

    def where(self, rank: int) -> dict:
        """Where ``rank`` runs, known on every rank from the start of training: ``{"host", "node", "gpu"}`` (node:
        Slurm's name for it, SLURMD_NODENAME, else the host name; gpu: its GPU's UUID, None on CPU)."""
        return self._where[rank] if 0 <= rank < len(self._where) else {"host": None, "node": None, "gpu": None}

    def subscribe(self, subscriber: Subscriber) -> None:
        """Receive every published event (``send``) and the flushes at the end of the run."""
        self._subscribers.append(subscriber)

    def set_saver(self, saver) -> None:
        """The checkpoint writer: ``saver.save(trainer, reason) -> path`` and ``saver.wait_for_save(trainer)``."""
        self._saver = saver

    def request_save(self, reason: str) -> None:
        """Save a checkpoint at this step boundary (from a listener: every rank asks alike)."""
        self._saves.append(reason)

    def request_stop(self, stop: Stop) -> None:
        """End the run at this step boundary on every rank (from a listener: every rank asks alike)."""
        self._stops.append(stop)

    def publish(self, event: Event) -> None:
        """Hand ``event`` to every subscriber now; never blocks, never raises."""
        for subscriber in self._subscribers:
            try:
                subscriber.send(event)
            except Exception:  # noqa: BLE001 - a sink's failure must not end the run; logged with its traceback
                # Sinks are notifications (webhook queue, console, TensorBoard: a full disk, a closed stdout, a bug).
                # publish runs on one rank (rank 0's run events), in the breaker's thread and in on_exception:
                # raising there would leave the other ranks in the next exchange or hide the original error.
                log.exception("lit-dist: event subscriber %r failed", subscriber)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait (bounded by each subscriber's own deadline) until the published events are out."""
        for subscriber in self._subscribers:
            subscriber.flush(timeout_s)

    # -- setup -------------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._connected:
            return
        self._connected = True
        self.subscribe(Console())
        # Every component that takes part gets the control; none of them gets another component.
        for component in [*trainer.callbacks, getattr(trainer, "datamodule", None), pl_module, *trainer.loggers]:
            if component is not self and callable(getattr(component, "connect", None)):
                component.connect(self)

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        # Facts travel by position in this order; components shared them at setup, so it is fixed from here.
        self._names = sorted(self._facts)
        self._layout = {name: (i, self._facts[name][0]) for i, name in enumerate(self._names)}
        self._readers = [self._facts[name][1] for name in self._names]
        mine = {"host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                "gpu": _gpu_uuid(trainer.strategy.root_device)}
        self._where = [mine]
        if trainer.world_size > 1:
            # Once per fit, not per step: every rank must share the same facts; and where each rank runs.
            from lit_dist.runtime.distributed import all_gather_object

            gathered = all_gather_object(trainer, (self._names, mine))
            layouts, self._where = [g[0] for g in gathered], [g[1] for g in gathered]
            if any(layout != layouts[0] for layout in layouts):
                raise ConfigError("run control: ranks share different facts ("
                                  + "; ".join(f"rank {r}: {', '.join(names) or 'none'}" for r, names in enumerate(layouts))
                                  + "); every rank must run the same callbacks")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        for hook in self._epoch_hooks:
            hook(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._inflight is not None:  # the last window's exchange: finished before the process group goes
            self._collect()
        for hook in self._end_hooks:
            hook(trainer)

    # -- every step boundary -------------------------------------------------------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:  # between accumulated micro-batches: no optimizer step, no decision
            return
        self._last_step = step
        if trainer.world_size == 1:  # nothing to agree with: the local facts are the agreed ones
            facts = np.array([[float(read()) for read in self._readers]], dtype=np.float64)
            self._decide(trainer, Agreed(step, self._layout, facts))
        else:
            if self._inflight is not None:
                self._decide(trainer, self._collect())
            if step % self.sync_every_n_steps == 0:
                self._launch(trainer, step)
        self._act(trainer)
        now = time.monotonic()
        if trainer.is_global_zero and now - self._last_progress >= self.progress_every_s:
            self._last_progress = now  # reading the metrics copies them to the host: only this rarely
            self.publish(Event("run.progress", "info", f"Step {step}", "",
                               {"step": step, "epoch": trainer.current_epoch, **metrics(trainer, "train/")}))

    def _read(self) -> torch.Tensor:
        return torch.tensor([float(read()) for read in self._readers], dtype=torch.float64)

    def _launch(self, trainer, step: int) -> None:
        """Start the all-gather of this rank's facts; ``_collect`` reads it at the next boundary."""
        import torch.distributed as dist

        world, device = trainer.world_size, trainer.strategy.root_device
        local = self._read()
        n = len(local)
        if device.type == "cuda":
            # Pinned buffers and non-blocking copies: the host never waits for the device here.
            local = local.pin_memory().to(device, non_blocking=True)
        gathered = torch.empty(world * n, dtype=torch.float64, device=device)
        work = dist.all_gather_into_tensor(gathered, local, async_op=True)
        done = None
        if device.type == "cuda":
            work.wait()  # for NCCL: the current stream waits for the collective; the host does not
            host = torch.empty(world * n, dtype=torch.float64, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            gathered = host
        self._inflight = (step, work, done, gathered, world, n)

    def _collect(self) -> Agreed:
        step, work, done, gathered, world, n = self._inflight
        self._inflight = None
        if done is not None:
            done.synchronize()  # the exchange of the previous boundary: not the work queued since
        else:
            work.wait()
        return Agreed(step, self._layout, gathered.view(world, n).cpu())

    def _decide(self, trainer, agreed: Agreed) -> None:
        for listener in self._listeners:
            listener(trainer, agreed)

    def _act(self, trainer) -> None:
        """Carry out what listeners asked for, in the documented order, on every rank."""
        if not self._saves and not self._stops:
            return
        stop = min(self._stops, key=lambda s: s.rank) if self._stops else None
        reasons = self._saves + ([stop.save] if stop is not None and stop.save else [])
        self._saves, self._stops = [], []
        saved = None
        if reasons and self._saver is not None:
            reason = stop.save if stop is not None and stop.save else reasons[0]
            saved = self._saver.save(trainer, reason)
        if stop is None:
            return
        if self._saver is not None:
            # Whatever save is in flight (this stop's or an earlier one) completes before the run ends; one that
            # failed (the disk filled) is the cause, raised in place of the stop's error (the logs that no longer fit).
            self._saver.wait_for_save(trainer)
        if stop.announce is not None:
            stop.announce(trainer, saved)
        self.flush()
        # Every rank waits for the announcement (rank 0's requeue): under srun --kill-on-bad-exit the
        # first rank to exit would have the others killed, rank 0 perhaps before its scontrol call.
        trainer.strategy.barrier("lit-dist-stop")
        raise stop.make_error(saved)

    # -- run-level events (rank 0) --------------------------------------------------------------

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.publish(Event("run.started", "info", "Run started", f"{trainer.world_size} processes",
                               {"world_size": trainer.world_size, "max_epochs": trainer.max_epochs,
                                "max_steps": trainer.max_steps}))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking and trainer.state.fn == "fit":
            self.publish(Event("validation.finished", "info", f"Validation at step {trainer.global_step}", "",
                               {"step": trainer.global_step, "epoch": trainer.current_epoch, **metrics(trainer, "val/")}))

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.publish(Event("run.finished", "info", "Run finished", "",
                               {"step": trainer.global_step, "epoch": trainer.current_epoch, **metrics(trainer, "val/"),
                                **{name: read() for name, read in self._summaries.items()}}))
        self.flush()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lit_dist.errors import Preempted

        # A preemption announced itself (run.preempted); a GPU fault was published by the rank that saw it.
        if trainer.is_global_zero and not isinstance(exception, Preempted):
            self.publish(Event("run.failed", "error", "Run failed", f"{type(exception).__name__}: {exception}"[:1500],
                               {"exception": type(exception).__name__, "step": trainer.global_step,
                                "exit_code": int(getattr(exception, "exit_code", ExitCode.FAILURE))}))
        self.flush()


class Console:
    """The console's subscription: warnings and worse as one line each in the log of the rank that has them."""

    def send(self, event: Event) -> None:
        if event.type in ("run.failed", "run.hung"):  # the process's own line says it, once (the hang watchdog's)
            return
        if event.severity != "info":
            log.warning("lit-dist: %s", event.message or event.title)
            return
        log.info("lit-dist: %s%s", event.title, f": {event.message}" if event.message else "")

    def flush(self, timeout_s: float | None = None) -> bool:
        return True


def metrics(trainer, prefix: str) -> dict:
    """The trainer's logged metrics under ``prefix``, as plain numbers for an event."""
    return {k: round(float(v), 6) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}


def _gpu_uuid(device) -> str | None:
    """The UUID NVML and nvidia-smi show for a CUDA device (GPU-...), or None."""
    if device.type != "cuda":
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return uuid if not uuid or uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
