"""Bad samples: images that could not be read, counted on every rank and judged over all of them.

Every rank replaces its unreadable images on its own (another sample of the same bucket), so the
counts differ between ranks. ``BadSamples`` shares this rank's counts with the run control; their
sums over ranks arrive at the same step on every rank, where:

- ``data/bad_samples`` (all ranks summed) is logged whenever it changed,
- the run stops with the data error (exit 3) on every rank together once more than
  ``data.max_bad_fraction`` of the samples seen were unreadable (after ``min_samples``).
"""

from lit_dist.errors import DataError
from lit_dist.runtime.control import Agreed, RunControl, Stop


class BadSamples:
    """This rank's count of unreadable samples, and the run-wide verdict on it."""

    def __init__(self, max_bad_fraction: float = 0.01, min_samples: int = 1000):
        self.max_bad_fraction = max_bad_fraction
        self.min_samples = min_samples  # a few bad images early are no verdict
        self.seen = 0
        self.bad = 0
        self.logged: float | None = None

    def count(self, batch: dict) -> None:
        """Count a batch on its way to the device (its ``bad_samples`` entry leaves the batch here)."""
        if "bad_samples" in batch:
            self.bad += int(batch.pop("bad_samples"))
            self.seen += len(batch["weight"])

    def connect(self, control: RunControl) -> None:
        control.share("data.bad_samples", "sum", lambda: self.bad)
        control.share("data.samples_seen", "sum", lambda: self.seen)
        self._control = control
        control.on_agreed(self._judge)

    def _judge(self, trainer, agreed: Agreed) -> None:
        bad, seen = agreed["data.bad_samples"], agreed["data.samples_seen"]
        if bad != self.logged and trainer.is_global_zero and trainer.logger is not None:
            # Straight to the logger: a value logged from a hook reaches it only on logging steps.
            trainer.logger.log_metrics({"data/bad_samples": bad}, step=agreed.step)
        self.logged = bad
        if seen >= self.min_samples and bad / seen > self.max_bad_fraction:
            self._control.request_stop(Stop(DataError(
                f"{bad:.0f} of {seen:.0f} samples ({bad / seen:.1%}) could not be read, more than "
                f"data.max_bad_fraction = {self.max_bad_fraction}. The log names the first bad files of each rank; "
                "fix or remove them (lit-dist index rescans a folder), or raise data.max_bad_fraction.")))
