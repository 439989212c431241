"""``Preemption``: on SIGUSR1 (Slurm's warning) or SIGTERM, save together, requeue, exit 11.

The signal handler only sets a flag: saving inside a handler interrupts the training thread at
an arbitrary point and can hang in a collective (Lightning #21406, which is why Lightning's own
``auto_requeue`` is turned off). At the next step boundary, all ranks agree through one small
all-reduce (every ``check_every_n_steps`` steps); then, on every rank together:

1. ``Checkpointing`` saves the step (the atomic save; waits for any asynchronous one),
2. rank 0 sends ``run.preempted`` to the webhooks and runs ``scontrol requeue`` for the job
   (``ARRAYJOB_TASK`` for array tasks),
3. every rank exits with code 11 ("preempted"; README.md, "Exit codes").

Outside Slurm (a SIGTERM from Kubernetes, say) the same save happens, then the exit with 11.
The requeued job resumes from that checkpoint (``ckpt_path: auto``), at the same step and data
position. Only the step in flight when the signal came is lost.

Submit with ``#SBATCH --signal=USR1@120 --requeue`` (the templates in ``slurm/`` do)::

    preemption:
      signals: [SIGUSR1, SIGTERM]
"""

import logging
import os
import signal
import threading
import time

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.callbacks.webhooks import notifiers
from lit_dist.distributed import agree_any
from lit_dist.errors import ConfigError, Preempted
from lit_dist.slurm import job_id, requeue

log = logging.getLogger(__name__)


class Preemption(Callback):
    """Turns a preemption signal into an agreed checkpoint, a requeue and exit code 11."""

    def __init__(self, signals: list[str] | None = None, requeue: bool = True, check_every_n_steps: int = 1):
        """Preemption settings.

        Args:
            signals: Signals that mean "you will be stopped soon" (default SIGUSR1 and SIGTERM).
            requeue: Under Slurm, requeue the job after saving (scontrol requeue).
            check_every_n_steps: Steps between the all-reduces in which ranks agree on a signal.
        """
        names = list(signals) if signals is not None else ["SIGUSR1", "SIGTERM"]
        problems = [f"preemption.signals: {n!r} is not a signal name (e.g. SIGUSR1, SIGTERM)"
                    for n in names if not isinstance(getattr(signal, str(n), None), signal.Signals)]
        if check_every_n_steps < 1:
            problems.append(f"preemption.check_every_n_steps: {check_every_n_steps} must be at least 1")
        ConfigError.collect(problems)
        self.signals = names
        self.requeue = requeue
        self.check_every_n_steps = check_every_n_steps
        self.received: str | None = None
        self.received_at: float | None = None
        self._previous: dict = {}
        self._last_step = 0

    def _handler(self, signum, frame) -> None:
        # Only a flag: anything more (I/O, collectives) could run in the middle of a CUDA call or a collective.
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning registered its own handlers (at the start of fit), so these replace them.
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handler)

    def on_train_end(self, trainer, pl_module) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Only right after an optimizer step: a save between accumulated micro-batches would lose their gradients.
        if step == self._last_step or step % self.check_every_n_steps:
            return
        self._last_step = step
        if not agree_any(trainer, self.received is not None):
            return
        started = time.monotonic()
        checkpointing = Checkpointing.of(trainer)
        saved = None
        if checkpointing is not None:
            saved = checkpointing.save(trainer, "preemption")
            checkpointing.wait_for_save(trainer)
        what = f"saved {saved}" if saved else "not saved: no Checkpointing callback"
        if trainer.is_global_zero:
            outcome = requeue() if self.requeue and job_id() else "not requeued"
            waited = f"{started - self.received_at:.1f} s after the signal" if self.received_at else "on another rank's signal"
            message = f"preempted ({self.received or 'signal on another rank'}) at step {trainer.global_step}, {waited}; {what}; {outcome}"
            rank_zero_info(f"lit-dist: {message}")
            self._notify(trainer, message, saved, outcome)
        # Every rank waits for rank 0's requeue: under srun --kill-on-bad-exit, the first rank to exit
        # would have the others killed, rank 0 perhaps before its scontrol call.
        trainer.strategy.barrier("lit-dist-preempted")
        raise Preempted(f"preempted at step {trainer.global_step}; checkpoint {what}; "
                        "the run resumes from it when started again (ckpt_path: auto)")

    def _notify(self, trainer, message: str, saved: str | None, outcome: str) -> None:
        for notifier in notifiers(trainer):
            notifier.notify("run.preempted", "warning", f"Preempted at step {trainer.global_step}", message,
                            {"step": trainer.global_step, "epoch": trainer.current_epoch, "signal": self.received,
                             "checkpoint": saved, "requeue": outcome, "job_id": job_id(),
                             "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0))})
            notifier.flush()
