"""Training in this process, as the resume tests of several tiers do it: the demo data, DropoutCNN (every step
draws from the global RNG), lit-dist's Checkpointing, stopped at a step and resumed with ``ckpt_path: auto``."""

import torch
from lightning.pytorch import Trainer, seed_everything

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.model.module import LitModel
from lit_dist.model.nets import TinyUNet
from lit_dist.runtime.control import RunControl
from tests.helpers.nets import DropoutCNN
from tests.helpers.recorder import StopAfterEpoch, StopAtStep


def run(root, demo_data, max_steps, stop=None, resume=False, restore_rng=True, stop_after_epoch=None,
        dirpath=None, storage_options=None, batch_size=8, extra=(), data=None, input_key="image", objective=None,
        optimizer=None):
    """Train to ``max_steps`` (or stop at step ``stop``) with checkpoints in ``dirpath`` (``root/ckpt`` by default);
    ``resume`` picks up the newest one; with an ``objective`` (a generative one) a small TinyUNet learns it; with an
    ``optimizer`` (params -> optimizer) it steps instead of AdamW. Returns (model, trainer, checkpointing)."""
    seed_everything(0)
    net = DropoutCNN(num_classes=4) if objective is None else TinyUNet(channels=(8, 16), num_classes=5, embed_dim=16)
    model = LitModel(net, objective=objective, optimizer=optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)),
                     input_key=input_key)
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=batch_size, num_workers=0, val_fraction=0.1,
                          **(data or {}))
    checkpointing = Checkpointing(dirpath=dirpath or str(root / "ckpt"), every_n_epochs=None, storage_options=storage_options)
    if not restore_rng:
        checkpointing.on_load_checkpoint = lambda *args: None
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[RunControl(), checkpointing] + ([StopAtStep(stop)] if stop else [])
                      + ([StopAfterEpoch(stop_after_epoch)] if stop_after_epoch is not None else []) + list(extra),
                      num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root)
    ckpt_path = checkpointing.resolve_ckpt_path(trainer, "auto") if resume else None
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer, checkpointing


def train_sampler(demo_data, batch_size=8):
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=batch_size, num_workers=0, val_fraction=0.1)
    dm.setup("fit")
    return dm.train_sampler(1, 0)


def steps_per_epoch(demo_data, batch_size=8) -> int:
    return len(train_sampler(demo_data, batch_size))
