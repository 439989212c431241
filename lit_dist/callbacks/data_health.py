"""``BadSampleMonitor``: counts images that could not be read, and stops a run drowning in them.

``BucketDataModule`` adds it to the trainer itself, so there is nothing to configure
unless the defaults are wrong for you::

    data:
      max_bad_fraction: 0.01      # stop when more than 1 % of the samples seen were unreadable

It logs:

======================  ===================================================
``data/bad_samples``    unreadable images replaced so far, all ranks summed
======================  ===================================================

Every rank replaces its bad images on its own, so the counts differ between
ranks; the decision to stop is taken from their sum, with one small all-reduce
every ``check_every_n_steps`` steps, by all ranks at the same step: no rank
stops alone while the others wait in a collective.
"""

import torch
from lightning.pytorch import Callback

from lit_dist.errors import DataError


class BadSampleMonitor(Callback):
    """Sums bad-sample counts over ranks at step boundaries; fails the run above a fraction."""

    def __init__(self, max_bad_fraction: float = 0.01, check_every_n_steps: int = 50, min_samples: int = 1000):
        """Watch unreadable images.

        Args:
            max_bad_fraction: Stop with a data error when more than this share of the samples seen was unreadable.
            check_every_n_steps: Steps between the all-reduces that sum the counts over ranks.
            min_samples: Samples to see before the fraction is judged (a few bad images early are no verdict).
        """
        self.max_bad_fraction = max_bad_fraction
        self.check_every_n_steps = check_every_n_steps
        self.min_samples = min_samples
        self.seen = 0
        self.bad = 0

    def count(self, batch: dict) -> None:
        """Called for each batch on its way to the device (by BucketDataModule)."""
        if "bad_samples" in batch:
            self.bad += int(batch.pop("bad_samples"))
            self.seen += len(batch["weight"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.check_every_n_steps:
            return
        totals = trainer.strategy.reduce(torch.tensor([self.bad, self.seen], dtype=torch.float64, device=pl_module.device),
                                         reduce_op="sum")
        bad, seen = (float(v) for v in totals)
        pl_module.log("data/bad_samples", bad, rank_zero_only=True)
        if seen >= self.min_samples and bad / seen > self.max_bad_fraction:
            raise DataError(
                f"{bad:.0f} of {seen:.0f} samples ({bad / seen:.1%}) could not be read, more than "
                f"data.max_bad_fraction = {self.max_bad_fraction}. The log names the first bad files of each rank; "
                "fix or remove them (lit-dist index rescans a folder), or raise data.max_bad_fraction."
            )
