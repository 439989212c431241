"""Pieces shared by the benchmarks: in-memory data, a step timer, the machine description."""

import json
import os
import platform
import time

import torch
from lightning.pytorch import Callback, LightningDataModule


class InMemoryData(LightningDataModule):
    """Random uint8-range images and labels held in memory, as dict batches like BucketDataModule's."""

    def __init__(self, num_samples: int = 4096, size: int = 32, num_classes: int = 4, batch_size_per_device: int = 64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(num_samples, 3, size, size, generator=g)
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=g)
        self.batch_size_per_device = batch_size_per_device

    def train_dataloader(self):
        dataset = [{"image": self.images[i], "label": self.labels[i]} for i in range(len(self.labels))]
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size_per_device, shuffle=True, num_workers=0)


class StepTimer(Callback):
    """Prints one ``BENCH {...}`` line: wall time of the first step and steps/s after a warm-up."""

    def __init__(self, warmup_steps: int = 20):
        super().__init__()
        self.warmup_steps = warmup_steps
        self.first_step_at = None
        self.start = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first_step_at is None:
            self.first_step_at = time.time()
        if trainer.global_step == self.warmup_steps:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        steps = trainer.global_step - self.warmup_steps
        elapsed = time.perf_counter() - self.start
        if trainer.is_global_zero:
            print("BENCH " + json.dumps({"first_step_at": self.first_step_at, "steps_per_s": steps / elapsed}), flush=True)


def machine() -> str:
    return f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def parse_bench(output: str) -> dict:
    for line in output.splitlines():
        if line.startswith("BENCH "):
            return json.loads(line[len("BENCH "):])
    raise RuntimeError("no BENCH line in output:\n" + output[-3000:])
