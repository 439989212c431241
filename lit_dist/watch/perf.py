"""What a training step costs and how fast it runs: FLOPs per sample, device peaks, throughput windows.

- FLOPs are counted by PyTorch's FLOP counter (``torch.utils.flop_counter``) over one real forward and
  backward per batch shape (buckets differ in shape and cost), per sample. Like the MFU convention of
  the field (PaLM, Megatron), they count matrix multiplications and convolutions of forward and backward,
  not the optimizer, norms or elementwise work.
- Peaks are the dense figures (no sparsity) of the vendors' data sheets for the dtype the run's matrix
  products run in: bf16 or fp16 under mixed or true half precision, TF32 (or bf16) for float32 unless
  ``torch.set_float32_matmul_precision("highest")``, true fp32 then; MFU against them. Any other
  device or precision (fp64, fp8): ``peak_tflops`` in the config.
"""

import time
from dataclasses import dataclass, field, replace

# TFLOP/s of dense matrix math by the dtype it runs in, by a fragment of torch.cuda.get_device_name(); the first
# match wins (PCIe before SXM). Lightning's table (lightning.fabric.utilities.throughput.get_available_flops) has
# the same dtypes but gives H200 figures with sparsity and matches no plain "NVIDIA H200", reads an L40S as an
# L4, and knows no AMD GPU. MI250X has no TF32: float32 products run on its fp32 matrix cores.
#                 fp32    tf32    bf16    fp16
PEAK_TFLOPS = (
    ("H100 PCIe", (51.2, 378.0, 756.0, 756.0)),
    ("H100", (66.9, 494.7, 989.4, 989.4)),  # SXM and NVL report "H100 80GB HBM3" / "H100 NVL"
    ("H200", (67.0, 494.7, 989.4, 989.4)),
    ("A100", (19.5, 156.0, 312.0, 312.0)),
    ("L40S", (91.6, 183.0, 362.1, 362.1)),
    ("MI300X", (163.4, 653.7, 1307.4, 1307.4)),
    ("MI250X", (95.7, 95.7, 383.0, 383.0)),
)
DTYPES = ("fp32", "tf32", "bf16", "fp16")


def matmul_dtype(precision: str, float32_matmul_precision: str) -> str | None:
    """The dtype a run's matrix products run in, from ``trainer.precision`` ("bf16-mixed", "16-true", "32-true",
    ...) and ``torch.get_float32_matmul_precision()``; None for fp64 and fp8 (Transformer Engine)."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16") or precision == "transformer-engine-float16":
        return "fp16"
    if precision.startswith("32"):
        return {"highest": "fp32", "high": "tf32", "medium": "bf16"}[float32_matmul_precision]
    return None


def peak_tflops(device_name: str, precision: str, float32_matmul_precision: str) -> float | None:
    """The dense peak of a GPU named ``device_name`` (torch.cuda.get_device_name()) for a run at ``precision``
    (``trainer.precision``) and ``float32_matmul_precision``, or None if unknown."""
    dtype = matmul_dtype(precision, float32_matmul_precision)
    peaks = next((peaks for fragment, peaks in PEAK_TFLOPS if fragment.lower() in device_name.lower()), None)
    return peaks[DTYPES.index(dtype)] if peaks is not None and dtype is not None else None


class FlopMeter:
    """Counts the FLOPs of what runs between ``start`` and ``stop`` (one forward and backward)."""

    def __init__(self):
        self._mode = None

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        mode = _counter()
        mode.__enter__()
        self._mode = mode  # only once entered: a failed start leaves the meter stopped, not half running

    def stop(self) -> int:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops())


def _counter():
    """A FLOP counter: torch's formulas (``torch.utils.flop_counter``'s registry: matrix products, convolutions,
    attention) applied to each operator as it runs, the sum kept. torch's own FlopCounterMode also tracks the
    module each operator runs in (hooks on every module's forward and backward) and tries to decompose every
    operator it has no formula for: a counted step of a small U-Net took 1.1 s where it takes 0.75 s, and a run
    meets each bucket shape's counted step once, some of them long after its start; counting alone costs 0.05 s.
    In training every operator that reaches this mode (below autograd) is one the registry has or one of no
    FLOPs: its counts equal torch's (tests/unit/test_perf.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **kwargs, out_val=out)
            return out

        def get_total_flops(self) -> int:
            return self.total

    return Counter()


@dataclass
class Totals:
    """Running sums of this rank's training loop since training started; a window is the difference of two."""

    samples: int = 0
    steps: int = 0
    flops: float = 0.0
    training: float = 0.0  # seconds from a batch's start to its end (checkpoint saves taken out)
    waiting: float = 0.0  # seconds between a batch's end and the next one's start: the loader
    paused: float = 0.0  # seconds spent outside training (validation, its samples excluded)
    sampling: float = 0.0  # seconds of samples (lit_dist.callbacks.samples), at validation or between steps
    checkpoint: float = 0.0  # seconds the loop was held by checkpoint saves (rank 0: the others are not told)
    buckets: dict = field(default_factory=dict)  # (H, W) -> [samples, seconds in their steps]

    def mark(self) -> tuple[float, "Totals"]:
        """(now, a copy of the sums): where a window begins."""
        return time.perf_counter(), replace(self, buckets={k: list(v) for k, v in self.buckets.items()})

    def figures(self, mark: tuple[float, "Totals"], world_size: int, peak: float | None) -> dict[str, float]:
        """Throughput since ``mark``: samples/s (device and job), TFLOP/s per device, MFU, data-wait fraction."""
        started, then = mark
        seconds = max(time.perf_counter() - started - (self.paused - then.paused) - (self.checkpoint - then.checkpoint)
                      - (self.sampling - then.sampling), 1e-9)
        samples = self.samples - then.samples
        figures = {"samples_per_s_per_device": samples / seconds,
                   "samples_per_s": samples / seconds * world_size,  # every rank has as many batches
                   "data_wait": min((self.waiting - then.waiting) / seconds, 1.0),
                   "seconds_per_step": seconds / max(self.steps - then.steps, 1)}
        flops = self.flops - then.flops
        if flops:
            figures["tflops_per_device"] = flops / seconds / 1e12
            if peak:
                figures["mfu"] = figures["tflops_per_device"] / peak
        for (height, width), (count, spent) in sorted(self.buckets.items()):
            before = then.buckets.get((height, width), (0, 0.0))
            if spent > before[1]:
                figures[f"samples_per_s_bucket_{width}x{height}"] = (count - before[0]) / (spent - before[1])
        return figures
