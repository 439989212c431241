"""``SaveConfig``: the run's ``config.yaml``, written by rank 0 as Lightning's SaveConfigCallback writes it, where a
write that fails ends every rank with the same line.

Lightning's callback writes the file on rank 0 and then broadcasts that it did: a full or read-only run directory
raised in rank 0 alone, before the broadcast, and the other ranks, waiting in it, ended with a dump of C++ frames
and a line blaming rank 0 for going away.
"""

import os

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import SaveConfigCallback

from lit_dist.ckpt.space import storage_full
from lit_dist.errors import LitDistError, StorageFull


class SaveConfig(SaveConfigCallback):
    """Writes ``config.yaml`` into the run directory (rank 0); a failed write is agreed on and raised on every rank.
    lit-dist overwrites the file of an earlier attempt (``save_config_kwargs``), so Lightning's check that it does
    not exist is left out. Where the file exists (a resume into its run directory), it is replaced only once the
    checkpoint is restored and accepted (on train start): a resume refused at the checkpoint (another base, another
    network) leaves the config.yaml that the checkpoint was saved with."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.already_saved:
            return
        path = os.path.join(trainer.log_dir, self.config_filename)  # every rank: log_dir is a broadcast
        if not trainer.strategy.broadcast(trainer.is_global_zero and os.path.isfile(path)):  # rank 0's answer
            self._write(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module, "fit")

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn != "fit":  # within a fit, train start comes first (after the sanity check)
            self._write(trainer, pl_module, "validate")

    def on_test_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module, "test")

    def on_predict_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module, "predict")

    def _write(self, trainer, pl_module, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = trainer.log_dir  # every rank: Lightning broadcasts rank 0's
        problem = None  # (full, line), decided by rank 0
        if trainer.is_global_zero:
            path = os.path.join(log_dir, self.config_filename)
            try:
                if self.save_to_log_dir:
                    get_filesystem(log_dir).makedirs(log_dir, exist_ok=True)
                    self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite,
                                     multifile=self.multifile)
                self.save_config(trainer, pl_module, stage)
            except OSError as exc:
                if exc.filename is None:  # a write's error names no file
                    exc.filename = path
                if os.path.isfile(path):  # truncated by the write: no half a record of the run
                    os.remove(path)
                full = storage_full(exc)
                problem = (True, str(full)) if full is not None else (False, f"cannot write {path}: {exc}")
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            full, line = problem
            raise StorageFull(line) if full else LitDistError(line)
        self.already_saved = True
