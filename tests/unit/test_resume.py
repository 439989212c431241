"""Stopping mid-epoch and resuming gives the same weights as never stopping (one process)."""

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.models import SimpleCNN
from lit_dist.module import LitModel


def run(tmp_path, demo_data, max_steps, ckpt_path=None, every=None):
    seed_everything(0)
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.1)
    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=bool(every), callbacks=callbacks, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer


def test_resume_mid_epoch_matches_an_uninterrupted_run_bitwise(tmp_path, demo_data):
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.1)
    dm.setup("fit")
    per_epoch = len(dm.train_sampler(1, 0))
    stop, end = per_epoch // 2, per_epoch + per_epoch // 3  # stop mid-epoch 0, end inside epoch 1
    straight, trainer = run(tmp_path / "a", demo_data, max_steps=end)
    assert trainer.global_step == end > per_epoch, "the run should cross an epoch boundary"
    run(tmp_path / "b", demo_data, max_steps=stop, every=stop)
    ckpt = next((tmp_path / "b").glob(f"*step={stop}*.ckpt"))
    saved = torch.load(ckpt, weights_only=False)
    assert saved["BucketDataModule"] == {"epoch": 0, "batches_done": stop}
    resumed, _ = run(tmp_path / "c", demo_data, max_steps=end, ckpt_path=str(ckpt))
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"
