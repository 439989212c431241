"""Callbacks the tests add to real `lit-dist fit` runs (`--trainer.callbacks+=tests.helpers.recorder.LossRecorder`)."""

import json
import os

from lightning.pytorch import Callback


def write_rank_json(trainer, name: str, value) -> None:
    """``value`` as ``{run dir}/{name}-rank{N}.json`` for this rank."""
    run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"{name}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(value, f)


class LossRecorder(Callback):
    """Writes every training step's loss of this rank to ``{run dir}/losses-rank{N}.json`` at the end."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "losses", self.losses)


class StopAtStep(Callback):
    """Stops training after optimizer step ``step`` on every rank, as a preempted run would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalAtStep(Callback):
    """Sends ``signal`` to this process after optimizer step ``step``, as Slurm or Kubernetes would."""

    def __init__(self, step: int, signal: str = "SIGUSR1"):
        self.step, self.signal = step, signal

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal))


class WeightsDigest(Callback):
    """Writes ``{run dir}/weights-rank{N}.json`` at the end: this rank's host and a sha256 of its weights."""

    def on_train_end(self, trainer, pl_module):
        import hashlib
        import socket

        digest = hashlib.sha256()
        for name, tensor in sorted(pl_module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        write_rank_json(trainer, "weights", {"host": socket.gethostname(), "rank": trainer.global_rank,
                                             "node_rank": trainer.node_rank, "sha256": digest.hexdigest()})


class StopAfterEpoch(Callback):
    """Stops training when epoch ``epoch`` ends, as early stopping does."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch >= self.epoch:
            trainer.should_stop = True


class RowRecorder(Callback):
    """Keeps, for every training batch of this rank, ``(epoch, metadata rows of its samples)``; at the end
    also writes them to ``{run dir}/{tag}-rank{N}.json``."""

    def __init__(self, tag: str = "rows"):
        self.tag = tag
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch["row"].tolist()))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, self.tag, self.batches)


class GatheredDtype(Callback):
    """Writes the dtypes an FSDP2 block's parameters have inside its forward (gathered) to ``{run dir}/gathered-rank{N}.json``."""

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule

        self.dtypes = set()
        block = next(m for m in pl_module.net.modules() if isinstance(m, FSDPModule) and m is not pl_module.net)
        # Registered after fully_shard's own pre-forward hook, so it runs once the block is gathered.
        block.register_forward_pre_hook(lambda module, args: self.dtypes.update(str(p.dtype) for p in module.parameters()))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "gathered", sorted(self.dtypes))
