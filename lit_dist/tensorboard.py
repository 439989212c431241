"""The TensorBoard logger of every run (``trainer.logger`` when the config leaves it unset)."""

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, whose events file is created when the first value is written.

    Lightning touches every logger's ``experiment`` when fit, validate, test or predict starts, and for
    TensorBoard that writes a new events file. A rerun of a finished run trains and logs nothing, so each
    rerun would leave one more empty events file in the run directory.
    """

    @property
    @rank_zero_experiment
    def experiment(self):
        if getattr(self, "_writer", None) is None:
            self._writer = _WriterOnFirstUse(lambda: LightningTensorBoardLogger.experiment.fget(self))
        return self._writer

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_writer": None}


class _WriterOnFirstUse:
    """Stands for a SummaryWriter and makes it at the first use; flush and close before then do nothing."""

    def __init__(self, make):
        self._make, self._writer = make, None

    def __getattr__(self, name: str):
        if self._writer is None:
            if name in ("flush", "close"):
                return lambda *args, **kwargs: None
            self._writer = self._make()
        return getattr(self._writer, name)
