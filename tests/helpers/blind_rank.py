"""One rank of a 2-process DDP run started as torchrun would start it (the tests set RANK, WORLD_SIZE...):
``python -m tests.helpers.blind_rank ROOT METADATA``. The test starts rank 1 in its own mount namespace
with an empty tmpfs over ROOT: the same path, but not the files rank 0 writes, as on a node without
the shared filesystem.
"""

import os
import sys

import torch
from lightning.pytorch import Trainer

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.cli.app import _leave_process_group
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import LitDistError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN

if __name__ == "__main__":
    root, metadata = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = BucketDataModule(metadata, resolution=32, batch_size_per_device=8, num_workers=0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                      enable_progress_bar=False, callbacks=[Checkpointing(dirpath=os.path.join(root, "ckpt"))])
    try:
        trainer.fit(model, data)
    except LitDistError as err:
        print(f"rank {rank}: lit-dist: error: {err}", flush=True)
        _leave_process_group()
        sys.exit(int(err.exit_code))
