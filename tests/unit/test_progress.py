"""Throughput that means something: FLOPs per sample against a hand count, data wait of a slow and a fast
loader, MFU from a configured peak, the peak table."""

import tempfile
import time

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lit_dist.callbacks.progress import Progress
from lit_dist.errors import ConfigError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime.control import RunControl
from lit_dist.watch.perf import peak_tflops


class Images(torch.utils.data.Dataset):
    def __init__(self, n=64, height=32, width=48, delay_s=0.0):
        self.n, self.delay_s = n, delay_s
        self.image = torch.randn(3, height, width)  # in memory: getting a sample costs nothing

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return {"image": self.image, "label": i % 4}


def fit(dataset, progress, steps=16, batch_size=4, log_every=4):
    seed_everything(0)
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, callbacks=[RunControl(), progress], num_sanity_val_steps=0,
                      limit_val_batches=0, log_every_n_steps=log_every, default_root_dir=tempfile.mkdtemp())
    trainer.fit(model, torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=0))
    return progress


def conv_flops(c_in, c_out, h_out, w_out, k=3):
    return 2 * c_in * c_out * k * k * h_out * w_out


def test_flops_per_sample_of_the_reference_cnn_equal_a_hand_count():
    progress = fit(Images(), Progress(peak_tflops=1.0), steps=2)
    # SimpleCNN (16, 32, 64) on 32 x 48: three stride-2 3x3 convolutions, then a 64 -> 4 linear head.
    convs = [conv_flops(3, 16, 16, 24), conv_flops(16, 32, 8, 12), conv_flops(32, 64, 4, 6)]
    head = 2 * 64 * 4
    forward = sum(convs) + head
    # Backward: the gradients of the weights (as much as the forward) and of the inputs (as much again),
    # except for the first convolution, whose input (the image) needs no gradient.
    backward = 2 * forward - convs[0]
    assert progress.flops_per_sample == {(3, 32, 48): forward + backward}


@pytest.mark.serial  # a share of wall time
def test_data_wait_is_near_one_with_a_slow_loader_and_near_zero_in_memory():
    # Steps of ~30 ms on this CPU. The in-memory figure is not 0: the wait, as the loop sees it, also holds
    # Lightning's own work between two steps (~4 ms here: 0.13 to 0.15 measured).
    slow = fit(Images(height=128, width=192, delay_s=0.05), Progress())
    fast = fit(Images(height=128, width=192), Progress())
    # Slow: 0.2 s of loading per batch of 4 against ~30 ms of compute, about 0.87 on an idle machine. Other
    # processes on the same cores stretch the compute and shift both fractions: the bounds say "mostly waiting"
    # and "mostly computing", not how fast.
    assert slow.last["data_wait"] > 0.6, slow.last
    assert fast.last["data_wait"] < 0.4, fast.last
    assert slow.last["samples_per_s"] < fast.last["samples_per_s"]


def test_mfu_from_a_configured_peak_and_per_bucket_throughput():
    progress = fit(Images(), Progress(peak_tflops=0.001))
    figures = progress.last
    assert figures["mfu"] == pytest.approx(figures["tflops_per_device"] / 0.001)
    assert figures["samples_per_s_bucket_48x32"] > 0
    assert "mfu" not in fit(Images(), Progress()).last, "on CPU, MFU only with a configured peak"


def test_peaks_by_gpu_name_and_bad_settings():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed", "high") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16-mixed", "high") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed", "high") == 312.0
    assert peak_tflops("AMD Instinct MI300X", "bf16-mixed", "high") == 1307.4
    assert peak_tflops("NVIDIA GeForce GTX 1080", "bf16-mixed", "high") is None
    with pytest.raises(ConfigError, match="progress.peak_tflops: -1"):
        Progress(peak_tflops=-1)


@pytest.mark.parametrize("gpu", ["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_the_peak_follows_the_precision_the_matrix_products_run_in(gpu):
    # An fp32 run measured against the bf16 peak would show an MFU 2x (TF32) to 16x (true fp32) too low.
    bf16 = peak_tflops(gpu, "bf16-mixed", "high")
    assert peak_tflops(gpu, "bf16-true", "highest") == bf16 == peak_tflops(gpu, "16-mixed", "high")
    assert peak_tflops(gpu, "32-true", "high") == bf16 / 2  # TF32 tensor cores (lit-dist's default)
    assert peak_tflops(gpu, "32-true", "highest") < bf16 / 10  # true float32: no tensor cores
    assert peak_tflops(gpu, "32-true", "medium") == bf16  # float32 products done in bf16
    assert peak_tflops(gpu, "64-true", "high") is None  # not in the table: progress.peak_tflops


class Stream(torch.utils.data.IterableDataset):
    """Images from a stream: no length, so no total number of steps."""

    def __iter__(self):
        image = torch.randn(3, 32, 48)
        return iter([{"image": image, "label": i % 4} for i in range(24)])


@pytest.mark.parametrize(("max_steps", "total"), [(-1, None), (5, 5)])
def test_a_loader_without_a_length_prints_steps_without_a_total_unless_max_steps_gives_one(max_steps, total, capsys):
    seed_everything(0)
    progress = Progress(log_every_s=1e-6)
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    trainer = Trainer(max_epochs=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[RunControl(), progress],
                      num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tempfile.mkdtemp())
    trainer.fit(model, torch.utils.data.DataLoader(Stream(), batch_size=4, num_workers=0))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lit-dist: step ")]
    assert progress._total_steps == total and lines, lines
    if total is None:
        assert all("/" not in line.split(" epoch")[0] for line in lines), lines  # never "step 3/-1 (-300%)"
    else:
        assert any(line.startswith("lit-dist: step 5/5 (100%)") for line in lines), lines


def test_a_flop_meter_that_fails_to_start_stays_stopped(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_dist.watch.perf import FlopMeter

    def refuse(self):
        raise RuntimeError("a mode stack that does not take it")

    monkeypatch.setattr(TorchDispatchMode, "__enter__", refuse)
    meter = FlopMeter()
    with pytest.raises(RuntimeError):
        meter.start()
    assert not meter.running  # so nobody stops (exits) a mode that was never entered


def test_the_flop_meter_counts_what_torch_s_flop_counter_counts():
    """Convolutions, linear layers and attention, forward and backward (the frozen layer's weight gradient not
    computed, so not counted): the meter's light counter and torch's FlopCounterMode agree."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_dist.watch.perf import FlopMeter

    conv, frozen, proj = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8, 8), torch.nn.Linear(8, 24)
    frozen.requires_grad_(False)

    def step():
        h = conv(torch.randn(2, 3, 8, 8)).flatten(2).transpose(1, 2)  # (2, 64, 8)
        q, k, v = proj(frozen(h)).chunk(3, dim=-1)
        torch.nn.functional.scaled_dot_product_attention(q, k, v).square().mean().backward()

    meter = FlopMeter()
    meter.start()
    step()
    counted = meter.stop()
    with FlopCounterMode(display=False) as reference:
        step()
    assert counted == reference.get_total_flops() > 0
