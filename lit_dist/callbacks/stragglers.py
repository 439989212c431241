"""``StragglerDetector``: the rank that slows the whole job, named.

In data-parallel training every rank waits for the slowest one at each gradient synchronisation, so
one slow device (throttled, a degraded link, a loader starved by a busy node) slows all of them, and
timing whole steps cannot say which: every rank's step lasts as long as the slowest rank's. So each
rank times only its own work, outside the collectives, per optimizer step:

- **data**: waiting for the batch (from the end of one training step to the start of the next);
- **forward**: from the start of the training step to the start of its backward;
- **backward**: from there until this rank's last gradient is accumulated (the gradient all-reduce
  then waits for the other ranks: that wait comes after this mark and is not counted);
- **optimizer**: the optimizer step, to the end of the batch.

On a GPU the last three are read from CUDA events once they have completed (``query()`` at a later
step, never a synchronisation); on CPU from the host clock. The running totals travel in the run
control's exchange (``control.sync_every_n_steps``; no collective of their own). Every
``window_steps`` optimizer steps every rank compares the ranks' work per step over that window:

- rank 0 logs ``straggler/slowest_rank`` and ``straggler/slowest_over_median`` (the slowest rank's
  work over the median of the *other* ranks' work) to TensorBoard;
- when the same rank is at least ``threshold`` times that median for ``windows`` windows in a row,
  rank 0 publishes ``run.straggler`` (severity warning) with its rank, host, GPU UUID and its seconds
  per step in each part against the other ranks' median; once per episode (again only after it
  recovered);
- with ``exclude_node`` (Slurm jobs only), every rank then stops at that step: a checkpoint is saved,
  rank 0 requeues the job with the straggler's node added to its excluded nodes, and the ranks exit
  with code 13, so that the job resumes on other nodes.

The slowest rank is left out of the median it is compared with, so the figure is what it costs: every
step waits for it, and lasts about that many times what a typical other rank needs. With 2 ranks it is the slower rank's
work over the faster one's (a rank doing 1.5x the other's work reads 1.50, where the median of both,
their mean, would read 1.20); with 3 or more it differs little from the median of all ranks.

Under FSDP and DeepSpeed ZeRO-3 the forward and backward contain parameter all-gathers, so their
figures include some waiting for the other ranks; the data and optimizer figures stay clean.
Configured by the CLI's ``straggler`` group::

    straggler:
      window_steps: 100
      threshold: 1.2
      windows: 3
"""

import logging
import time
from collections import deque

import numpy as np
from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, StragglerStop
from lit_dist.runtime.control import Agreed, Event, RunControl, Stop
from lit_dist.runtime.slurm import check_exclusion

log = logging.getLogger(__name__)

PARTS = ("data", "forward", "backward", "optimizer")
_FACTS = tuple(f"straggler.{name}" for name in (*(f"{p}_s" for p in PARTS), "steps"))


class StragglerDetector(Callback):
    """Times each rank's own work, compares the ranks every window, and names one that is persistently slower."""

    def __init__(self, enabled: bool = True, window_steps: int = 100, threshold: float = 1.2, windows: int = 3,
                 exclude_node: bool = False):
        """Straggler detection settings.

        Args:
            enabled: Time each rank's own work and compare the ranks (no collective of its own: the run control's exchange carries it).
            window_steps: Optimizer steps per comparison window (in whole run-control exchanges: at least control.sync_every_n_steps).
            threshold: A rank is slow in a window when its work per step is at least this many times the median of the other ranks' (above 1).
            windows: Consecutive slow windows of the same rank before run.straggler is sent.
            exclude_node: Under Slurm, then also save, requeue the job without the straggler's node and exit 13.
        """
        problems = []
        if window_steps < 1:
            problems.append(f"straggler.window_steps = {window_steps}: must be at least 1 (optimizer steps)")
        if threshold <= 1:
            problems.append(f"straggler.threshold = {threshold}: the slowest rank is always at least the other "
                            "ranks' median (1.0), so this would name a rank in every window; use a value above 1, "
                            "e.g. 1.2")
        if windows < 1:
            problems.append(f"straggler.windows = {windows}: must be at least 1")
        ConfigError.collect(problems)
        check_exclusion("straggler.exclude_node", exclude_node)
        self.enabled = enabled
        self.window_steps = window_steps
        self.threshold = threshold
        self.windows = windows
        self.exclude_node = exclude_node
        self.requeued: str | None = None  # what rank 0's requeue did, for the error message
        self.last: dict | None = None  # the last window's comparison (every rank)
        self._control: RunControl | None = None
        self._clock: _HostClock | _CudaClock = _HostClock()
        self._totals = np.zeros(len(_FACTS))  # seconds per part and optimizer steps, of completed steps
        self._pending: deque[list] = deque()  # per micro-batch: [data_s, start, before backward, last grad, optimizer, end, stepped]
        self._record: list | None = None
        self._ended: float | None = None  # host time the last training batch ended
        self._step: int | None = None
        self._hooks: list = []
        self._sentinel: int | None = None  # index of the parameter whose gradient is accumulated last
        self._fired: list[int] = []  # parameter indices in the order of their hooks, first step only
        self._base: tuple[int, np.ndarray] | None = None  # (step, every rank's totals) at the window's start
        self._streak: tuple[int, int] = (-1, 0)  # (rank, consecutive slow windows)

    def connect(self, control: RunControl) -> None:
        if not self.enabled:
            return
        self._control = control
        for i, name in enumerate(_FACTS):
            control.share(name, "max", lambda i=i: float(self._totals[i]))
        control.on_agreed(self._agreed)

    # -- start ------------------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        if self._control is None:
            raise ConfigError("StragglerDetector needs lit_dist.runtime.control.RunControl among the trainer's callbacks "
                              "(lit-dist fit adds it; add RunControl() when building a Trainer yourself)")
        self._clock = _CudaClock() if trainer.strategy.root_device.type == "cuda" else _HostClock()
        self._totals[:] = 0
        self._pending, self._record, self._ended, self._step = deque(), None, None, trainer.global_step
        self._base, self._streak = None, (-1, 0)
        self._sentinel, self._fired = None, []
        self._hook_every_parameter(pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._unhook()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._unhook()

    # -- the training thread: clock marks ---------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        waited = now - self._ended if self._ended is not None else 0.0
        self._record = [waited, self._clock.mark(), None, None, None, None, None]

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._record is not None:
            self._record[2] = self._clock.mark()

    def _on_grad(self, index: int) -> None:
        """A parameter's gradient was accumulated (autograd's thread): the last one ends this rank's backward."""
        if self._record is not None and self._record[2] is not None:
            self._record[3] = self._clock.mark()
        if self._sentinel is None:
            self._fired.append(index)

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._record is not None and self._record[3] is None:  # no hook fired (sharded parameters): includes the sync
            self._record[3] = self._clock.mark()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._record is not None:
            self._record[4] = self._clock.mark()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._record is None:
            return
        record, self._record = self._record, None
        record[5] = self._clock.mark()
        step = trainer.global_step
        record[6] = step != self._step  # an optimizer step ended (not an accumulated micro-batch)
        self._step = step
        self._pending.append(record)
        self._drain()
        self._ended = time.perf_counter()
        if record[6] and self._sentinel is None and self._fired:
            self._keep_only_the_last_hook()

    def on_validation_start(self, trainer, pl_module) -> None:
        self._ended = None  # the wait for the first batch after validation is the loader's start-up, not a straggle

    def _drain(self) -> None:
        """Add the micro-batches whose marks have completed (all of them on CPU) to the totals, in order."""
        while self._pending and self._clock.done(self._pending[0][5]):
            waited, start, backward, grad, optimizer, end, stepped = self._pending.popleft()
            backward = end if backward is None else backward
            grad = backward if grad is None else grad
            self._totals[0] += waited
            self._totals[1] += self._clock.seconds(start, backward)
            self._totals[2] += self._clock.seconds(backward, grad)
            self._totals[3] += self._clock.seconds(optimizer, end) if optimizer is not None else 0.0
            self._totals[4] += 1 if stepped else 0

    # -- the last gradient: a hook on the parameter accumulated last --------------------------------

    def _hook_every_parameter(self, pl_module) -> None:
        """For the first step: a hook on every trainable parameter, to learn which one autograd finishes with."""
        self._unhook()
        self._parameters = [p for p in pl_module.parameters() if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
                       for i, p in enumerate(self._parameters)]

    def _keep_only_the_last_hook(self) -> None:
        """After the first step, one hook per step instead of one per parameter (autograd's order is fixed)."""
        self._sentinel = self._fired[-1]
        self._unhook()
        sentinel = self._parameters[self._sentinel]
        self._hooks.append(sentinel.register_post_accumulate_grad_hook(lambda _p: self._on_grad(self._sentinel)))
        self._parameters = []

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- every exchange: the same comparison on every rank -----------------------------------------

    def _agreed(self, trainer, agreed: Agreed) -> None:
        if trainer.world_size < 2:
            return
        totals = np.array([agreed.per_rank(name) for name in _FACTS]).T  # [rank, part seconds + steps]
        if self._base is None:
            self._base = (agreed.step, totals)
            return
        if agreed.step - self._base[0] < self.window_steps:
            return
        delta = totals - self._base[1]
        self._base = (agreed.step, totals)
        steps = delta[:, -1]
        if (steps <= 0).any():  # a rank completed no step's timings in this window (its GPU far behind): no verdict
            return
        per_step = delta[:, :-1] / steps[:, None]  # [rank, part] seconds per optimizer step
        work = per_step.sum(axis=1)
        slowest = int(np.argmax(work))
        ratio = slowest_over_others(work, slowest)
        self.last = {"step": agreed.step, "slowest_rank": slowest, "slowest_over_median": ratio,
                     "work_s": work.tolist()}
        if trainer.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics({"straggler/slowest_rank": float(slowest),
                                        "straggler/slowest_over_median": ratio}, step=agreed.step)
        rank, count = self._streak
        if ratio < self.threshold:
            self._streak = (-1, 0)
            return
        count = count + 1 if rank == slowest else 1
        self._streak = (slowest, count)
        if count != self.windows:
            return
        if trainer.is_global_zero:
            self._control.publish(self._event(agreed.step, slowest, ratio, per_step))
        if self.exclude_node:  # every rank asks alike: they all compared the same figures
            self._control.request_stop(self._stop(agreed.step, slowest, ratio))

    def _stop(self, step: int, rank: int, ratio: float) -> Stop:
        node = self._control.where(rank)["node"]

        def announce(trainer, saved) -> None:
            if trainer.is_global_zero:
                from lit_dist.runtime.slurm import requeue

                self.requeued = requeue(exclude=[node])
                log.warning("lit-dist: straggler rank %d: %s", rank, self.requeued)

        def error(saved) -> StragglerStop:
            return StragglerStop(f"rank {rank} on node {node} did {ratio:.2f}x the other ranks' median work per step for "
                                 f"{self.windows} windows; stopped at step {step}, saved {saved or 'nothing'}; "
                                 f"{self.requeued or 'requeued by rank 0'}")

        return Stop(error, save="straggler", announce=announce)

    def _event(self, step: int, rank: int, ratio: float, per_step: np.ndarray) -> Event:
        median = np.median(np.delete(per_step, rank, axis=0), axis=0)  # (part,) over the other ranks
        where = self._control.where(rank)
        parts = ", ".join(f"{p} {per_step[rank, i] * 1e3:.1f} vs {median[i] * 1e3:.1f} ms"
                          for i, p in enumerate(PARTS))
        gpu = f" GPU {where['gpu']}" if where.get("gpu") else ""
        message = (f"rank {rank} ({where['host']}{gpu}) does {ratio:.2f}x the other ranks' median work per step for "
                   f"{self.windows} windows of {self.window_steps} steps ({parts}); every rank waits for it"
                   + (f"; stopping to requeue without node {where['node']}" if self.exclude_node else ""))
        return Event("run.straggler", "warning", f"Rank {rank} is a straggler", message,
                     {"step": step, "rank": rank, "host": where["host"], "node": where["node"],
                      "gpu_uuid": where.get("gpu"), "exclude_node": self.exclude_node,
                      "slowest_over_median": round(ratio, 4), "windows": self.windows,
                      "seconds_per_step": {p: round(float(per_step[rank, i]), 6) for i, p in enumerate(PARTS)},
                      "median_seconds_per_step": {p: round(float(median[i]), 6) for i, p in enumerate(PARTS)}})


def slowest_over_others(work: np.ndarray, slowest: int) -> float:
    """The slowest rank's work over the median of the other ranks' work (1.0 when they did none).

    Not over the median of all ranks: with 2 ranks that is their mean, and a rank doing 1.5x the other's work would
    read 1.2x. Leaving it out says what it costs at any world size.
    """
    median = float(np.median(np.delete(work, slowest)))
    return float(work[slowest] / median) if median > 0 else 1.0


class _HostClock:
    """Marks are host times: the work is done when the mark is taken (CPU training)."""

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def done(mark) -> bool:
        return True

    @staticmethod
    def seconds(a, b) -> float:
        return max(b - a, 0.0)


class _CudaClock:
    """Marks are CUDA events on the current stream: read once the last one of a step has completed, so that
    the host never waits for the device."""

    @staticmethod
    def mark():
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def done(mark) -> bool:
        return mark.query()

    @staticmethod
    def seconds(a, b) -> float:
        return max(a.elapsed_time(b) / 1e3, 0.0)
