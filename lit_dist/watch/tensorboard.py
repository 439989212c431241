"""The TensorBoard logger of every run (``trainer.logger`` when the config leaves it unset)."""

import logging
import threading

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment

from lit_dist.ckpt.space import full_error
from lit_dist.errors import StorageFull

log = logging.getLogger(__name__)


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger, whose events file is created when the first value is written, and which
    ends the run on every rank together when that file no longer fits.

    Lightning touches every logger's ``experiment`` when fit, validate, test or predict starts, and for
    TensorBoard that writes a new events file. A rerun of a finished run trains and logs nothing, so each
    rerun would leave one more empty events file in the run directory.

    On a full disk the writer's thread fails and every later call re-raises its error, in rank 0 alone, from
    wherever it logs (Lightning's loop, a run-control listener): rank 0 would end with a traceback while the
    other ranks wait for it in the next collective. Instead the writer stops writing, rank 0 shares the fact,
    and every rank stops at the next exchange with the same line (exit 16).
    """

    @property
    @rank_zero_experiment
    def experiment(self):
        if getattr(self, "_writer", None) is None:
            self._writer = _WriterOnFirstUse(lambda: LightningTensorBoardLogger.experiment.fget(self), lambda: self.log_dir)
        return self._writer

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_writer": None}

    def connect(self, control) -> None:
        """Share whether the events file stopped fitting on its disk (rank 0's writer; 0 elsewhere)."""
        self._control = control
        control.share("logs.storage_full", "max", lambda: 1.0 if self._full() is not None else 0.0)
        control.on_agreed(self._judge)

    def _full(self) -> OSError | None:
        writer = getattr(self, "_writer", None)
        return writer.full if isinstance(writer, _WriterOnFirstUse) else None

    def _judge(self, trainer, agreed) -> None:
        from lit_dist.runtime.control import Stop

        if agreed["logs.storage_full"]:
            # Every rank says the same line: no errno text or free space, which only rank 0 saw.
            self._control.request_stop(Stop(StorageFull(
                f"the run's TensorBoard events no longer fit in {self.log_dir} (rank 0 could not write there: no "
                "space or quota left). Free space there or move the run directory, then run the same command: it "
                "resumes from its newest complete checkpoint")))


class _WriterOnFirstUse:
    """Stands for a SummaryWriter and makes it at the first use; flush and close before then do nothing. Once
    making it or a write found the disk full (``full``), every call does nothing."""

    def __init__(self, make, log_dir):
        self._make, self._log_dir, self._writer = make, log_dir, None
        self.full: OSError | None = None

    def __getattr__(self, name: str):
        if self._writer is None:
            if name in ("flush", "close") or self.full is not None:
                return _nothing
            _quiet_writer_threads()
            try:
                # The writer writes its events file's first record as it is made: on a full disk making it fails.
                self._writer = self._make()
            except Exception as exc:
                self._stopped(exc, "making its events file")
                return _nothing
        value = getattr(self._writer, name)
        return self._guarded(name, value) if callable(value) else value

    def _guarded(self, name: str, call):
        def guarded(*args, **kwargs):
            if self.full is not None:
                return None
            try:
                return call(*args, **kwargs)
            except Exception as exc:
                self._stopped(exc, name)
                return None

        return guarded

    def _stopped(self, exc: Exception, doing: str) -> None:
        """Stop writing after ``exc`` if it says the disk is full (re-raised otherwise)."""
        if (full := full_error(exc)) is None:
            raise exc
        self.full = full
        log.warning("lit-dist: TensorBoard stopped writing (%s in %s: %s); the run stops at the next exchange of "
                    "the run control, exit 16", doing, self._log_dir(), full)


def _nothing(*args, **kwargs) -> None:
    return None


def _quiet_writer_threads() -> None:
    """Keep the traceback of TensorBoard's writer thread that met a full disk off the console: the thread dies
    with it, the next call re-raises it, and the logger says it in one line (once per process)."""
    previous = threading.excepthook
    if getattr(previous, "lit_dist_tensorboard", False):
        return

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and full_error(args.exc_value) is not None:
            return
        previous(args)

    hook.lit_dist_tensorboard = True
    threading.excepthook = hook
