"""Two DDP processes where rank 1 looks for checkpoints in another folder than rank 0 writes to,
as a node without the shared filesystem would: ``python -m tests.helpers.blind_rank ROOT METADATA``.

Lightning starts rank 1 by running this script again with LOCAL_RANK=1.
"""

import os
import sys

import torch
from lightning.pytorch import Trainer

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import LitDistError
from lit_dist.models import SimpleCNN
from lit_dist.module import LitModel

if __name__ == "__main__":
    root, metadata = sys.argv[1], sys.argv[2]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = BucketDataModule(metadata, resolution=32, batch_size_per_device=8, num_workers=0)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                      enable_progress_bar=False, callbacks=[Checkpointing(dirpath=os.path.join(root, f"node{rank}"))])
    try:
        trainer.fit(model, data)
    except LitDistError as err:
        print(f"rank {rank}: lit-dist: error: {err}", flush=True)
        sys.exit(int(err.exit_code))
