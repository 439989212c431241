"""``Preemption``: on SIGUSR1 (Slurm's warning) or SIGTERM, save together, requeue, exit 11.

The signal handler only sets a flag: saving inside a handler interrupts the training thread at
an arbitrary point and can hang in a collective (Lightning #21406, which is why Lightning's own
``auto_requeue`` is turned off). The flag is a fact shared with the run control
(``lit_dist.runtime.control``); once the ranks agree that any of them got the signal (at most
``control.sync_every_n_steps`` + 1 steps later), the run control, on every rank together:

1. saves the step (the atomic save; waits for any asynchronous one),
2. has rank 0 run ``scontrol requeue`` for the job (``ARRAYJOB_TASK`` for array tasks) and
   publish ``run.preempted``,
3. ends every rank with exit code 11 ("preempted"; docs/exit-codes.md).

Outside Slurm (a SIGTERM from Kubernetes, say) the same save happens, then the exit with 11.
The requeued job resumes from that checkpoint (``ckpt_path: auto``), at the same step and data
position: nothing trained is lost (the checkpoint is of the step at which the ranks stopped).

Submit with ``#SBATCH --signal=USR1@120 --requeue`` (the templates in ``slurm/`` do)::

    preemption:
      signals: [SIGUSR1, SIGTERM]
"""

import os
import signal
import threading
import time

from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, Preempted
from lit_dist.reading.workers import STOP_SIGNALS
from lit_dist.runtime.control import Agreed, Event, RunControl, Stop
from lit_dist.runtime.slurm import job_id, requeue


class Preemption(Callback):
    """Turns a preemption signal into an agreed checkpoint, a requeue and exit code 11."""

    def __init__(self, signals: list[str] | None = None, requeue: bool = True):
        """Preemption settings.

        Args:
            signals: Signals that mean "you will be stopped soon" (default SIGUSR1 and SIGTERM).
            requeue: Under Slurm, requeue the job after saving (scontrol requeue).
        """
        names = list(signals) if signals is not None else list(STOP_SIGNALS)
        ConfigError.collect([f"preemption.signals: {n!r} is not a signal name (e.g. SIGUSR1, SIGTERM)"
                             for n in names if not isinstance(getattr(signal, str(n), None), signal.Signals)])
        self.signals = names
        self.requeue = requeue
        self.received: str | None = None
        self.received_at: float | None = None
        self._previous: dict = {}
        self._control: RunControl | None = None
        self._stopping = False

    def connect(self, control: RunControl) -> None:
        self._control = control
        control.share("preemption.signal", "max", lambda: 1.0 if self.received is not None else 0.0)
        control.on_agreed(self._decide)

    def _handler(self, signum, frame) -> None:
        # Only a flag: anything more (I/O, collectives) could run in the middle of a CUDA call or a collective.
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum).name, time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        if self._control is None:
            raise ConfigError("Preemption needs lit_dist.runtime.control.RunControl among the trainer's callbacks "
                              "(lit-dist fit adds it; add RunControl() when building a Trainer yourself)")
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

    def _decide(self, trainer, agreed: Agreed) -> None:
        if agreed["preemption.signal"] and not self._stopping:
            self._stopping = True
            step = trainer.global_step
            self._control.request_stop(Stop(
                lambda saved: Preempted(f"preempted at step {step}; checkpoint {_saved(saved)}; "
                                        "the run resumes from it when started again (ckpt_path: auto)"),
                save="preemption", announce=self._announce))

    def _announce(self, trainer, saved: str | None) -> None:
        """Rank 0: requeue the job and tell the webhooks and the console."""
        if not trainer.is_global_zero:
            return
        outcome = requeue() if self.requeue and job_id() else "not requeued"
        waited = f"{time.monotonic() - self.received_at:.1f} s after the signal" if self.received_at else "on another rank's signal"
        message = (f"preempted ({self.received or 'signal on another rank'}) at step {trainer.global_step}, {waited}; "
                   f"{_saved(saved)}; {outcome}")
        self._control.publish(Event(
            "run.preempted", "warning", f"Preempted at step {trainer.global_step}", message,
            {"step": trainer.global_step, "epoch": trainer.current_epoch, "signal": self.received, "checkpoint": saved,
             "requeue": outcome, "job_id": job_id(), "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0))}))


def _saved(path: str | None) -> str:
    return f"saved {path}" if path else "not saved: no Checkpointing callback"
