"""The baseline: a plain Lightning script training the same model on the same in-memory data.

    python benchmarks/plain_lightning.py 220
"""

import sys

import torch
from lightning.pytorch import LightningModule, Trainer

from benchmarks.common import InMemoryData, StepTimer
from lit_dist.model.nets import SimpleCNN


class Plain(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = SimpleCNN(num_classes=4)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch["image"]), batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = Trainer(max_steps=int(sys.argv[1]), enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=sys.argv[2] if len(sys.argv) > 2 else "runs/bench-plain",
                      callbacks=[StepTimer()], log_every_n_steps=50)
    trainer.fit(Plain(), datamodule=InMemoryData())
