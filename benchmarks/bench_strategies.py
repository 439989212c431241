"""Samples/s and memory per strategy preset, one reference model: the GPU table of docs/benchmarks.md.

Each preset in configs/ runs `lit-dist fit` in its own process on the same model, data and
batch: a residual MLP (benchmarks.models.MLPClassifier; 415 M parameters on GPUs), random
in-memory 32x32 images, AdamW (DeepSpeed's CPU Adam where the preset offloads), lit-dist's
default precision (bf16-mixed on GPUs). Samples/s are timed after the warm-up steps; peak
memory is the most any rank's CUDA allocator held (torch.cuda.max_memory_allocated); and for
every preset, the bytes of parameters, gradients, optimizer state and ZeRO's own buffers that
rank 0 holds, counted from the tensors themselves (benchmarks.common.StateMemory). On one GPU no
preset shards anything, so memory there says little. `bash .ci/gpu` runs it on a GPU machine; the
H200 figures of docs/benchmarks.md are one GPU, batch 256, short windows: ``--steps 15 --warmup 5``
(ZeRO-3 and the offload presets ``--steps 8 --warmup 3``).

    .venv/bin/python -m benchmarks.bench_strategies              # every preset, all GPUs of the machine
    .venv/bin/python -m benchmarks.bench_strategies --presets ddp fsdp2 --devices 2
    .venv/bin/python -m benchmarks.bench_strategies --short      # 4 presets (one per kind), a tiny model, a few steps

Without CUDA: the presets that run on CPU (ddp, fsdp2, every DeepSpeed one) on 2 processes
with a small model (7.3 M parameters), in bf16-mixed (the GPU default); resident memory there is mostly the
interpreter, so the tensor counts are what compares. Targets (issue 34): ZeRO-3's total per rank
<= 0.6 of DDP's, ZeRO-1's optimizer state <= 0.6 of DDP's. In 32-true (`--precision 32-true`)
DeepSpeed keeps an fp32 master partition beside the fp32 parameters: ZeRO-3 holds 0.62 of DDP.
"""

import argparse
import sys
import tempfile

import torch

from benchmarks.common import SHORT_HELP, machine, result_line, run_bench
from benchmarks.models import MLPClassifier

DEEPSPEED = ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3", "deepspeed_zero3_offload"]
GPU_PRESETS = ["ddp", "fsdp", "fsdp2", *DEEPSPEED]
CPU_PRESETS = ["ddp", "fsdp2", *DEEPSPEED]
# A short run's: the two the ratios read, each other kind of strategy once (the other ZeRO presets only change
# DeepSpeed's own config).
SHORT_PRESETS = ["ddp", "fsdp2", "deepspeed_zero1", "deepspeed_zero3"]
BLOCKS = "[benchmarks.models.MLPBlock]"


def run(preset: str, args: argparse.Namespace, root: str) -> dict:
    steps = args.warmup + args.steps
    cmd = [sys.executable, "-m", "lit_dist", "fit", "--config", f"configs/{preset}.yaml",
           "--trainer.devices", str(args.devices), "--trainer.max_steps", str(steps),
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--trainer.enable_checkpointing", "false", "--export.filename", "null", "--run.root_dir", root,
           "--run.run_id", preset, "--trainer.callbacks+=benchmarks.common.StepTimer",
           "--trainer.callbacks.warmup_steps", str(args.warmup), "--trainer.callbacks+=benchmarks.common.PeakMemory",
           "--trainer.callbacks+=benchmarks.common.StateMemory",
           "--model.net", "benchmarks.models.MLPClassifier", "--model.net.width", str(args.width),
           "--model.net.depth", str(args.depth), "--data", "benchmarks.common.InMemoryData",
           "--data.num_samples", str(steps * args.batch * args.devices), "--data.batch_size_per_device", str(args.batch)]
    if not torch.cuda.is_available():
        cmd += ["--trainer.accelerator", "cpu"]
    if args.precision:
        cmd += ["--trainer.precision", args.precision]
    if "fsdp" in preset:
        cmd += ["--trainer.strategy.block_classes", BLOCKS]
    try:
        return run_bench(cmd)
    except RuntimeError as exc:  # a preset this machine cannot run: its row says lit-dist's error
        return {"error": str(exc).strip().splitlines()[-1]}

def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", help="default: every preset this machine runs (with --short, "
                                                     f"{', '.join(SHORT_PRESETS)})")
    parser.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2)
    parser.add_argument("--width", type=int, default=4096 if cuda else 1024)
    parser.add_argument("--depth", type=int, default=24 if cuda else 4)
    parser.add_argument("--batch", type=int, default=256 if cuda else 16, help="samples per device per step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30 if cuda else 10)
    # On CPU lit-dist's default is 32-true, where DeepSpeed keeps an fp32 master partition beside the fp32
    # parameters (ZeRO-3 then holds 0.62 of DDP): the memory comparison is made at the GPU default, bf16-mixed.
    parser.add_argument("--precision", default=None if cuda else "bf16-mixed",
                        help="trainer.precision for every preset (default: lit-dist's on GPUs, bf16-mixed on CPU)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:
        args.width, args.depth, args.batch, args.warmup, args.steps = 64, 2, 4, 2, 2
    args.presets = args.presets or (SHORT_PRESETS if args.short else GPU_PRESETS if cuda else CPU_PRESETS)
    with torch.device("meta"):
        params = sum(p.numel() for p in MLPClassifier(width=args.width, depth=args.depth).parameters())
    where = (f"{args.devices} x {torch.cuda.get_device_name(0)}" if cuda else f"{args.devices} CPU processes (gloo)")
    print(f"machine: {machine()}; {where}")
    print(f"model: MLPClassifier width {args.width} depth {args.depth}, {params / 1e6:.0f} M parameters; batch "
          f"{args.batch} per device; {args.steps} timed steps after {args.warmup}\n")
    memory = "peak CUDA memory per GPU" if cuda else "peak resident memory per process"
    mib = 2**20
    print(f"| preset | samples/s | {memory} | params | grads | optimizer | ZeRO buffers | total (rank 0, MiB) |\n"
          "|---|---|---|---|---|---|---|---|")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as root:
        for preset in args.presets:
            r = run(preset, args, root)
            if "error" in r:
                print(f"| `{preset}.yaml` | failed: {r['error'][:200]} | | | | | | |", flush=True)
                rows[preset] = {"error": r["error"][:200]}
                continue
            samples = r["steps_per_s"] * args.batch * args.devices
            held = " | ".join(f"{r[k] / mib:,.1f}" for k in ("params", "grads", "optimizer", "zero_buffers", "total"))
            print(f"| `{preset}.yaml` | {samples:,.0f} | {r['peak_bytes'] / 2**30:.1f} GiB | {held} |", flush=True)
            rows[preset] = {"samples_per_s": round(samples, 1), "peak_bytes": r["peak_bytes"],
                            **{k: r[k] for k in ("params", "grads", "optimizer", "zero_buffers", "total")}}
    ratios, targets = {}, {"zero3_total_vs_ddp": 0.6, "zero1_optimizer_vs_ddp": 0.6}
    if all("total" in rows.get(p, {}) for p in ("ddp", "deepspeed_zero3")):
        ratios["zero3_total_vs_ddp"] = round(rows["deepspeed_zero3"]["total"] / rows["ddp"]["total"], 3)
    if all("optimizer" in rows.get(p, {}) for p in ("ddp", "deepspeed_zero1")):
        ratios["zero1_optimizer_vs_ddp"] = round(rows["deepspeed_zero1"]["optimizer"] / rows["ddp"]["optimizer"], 3)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f} (target <= {targets[name]}) {'OK' if ratio <= targets[name] else 'MISSED'}")
    primary = ratios.get("zero3_total_vs_ddp")
    failed = [p for p, row in rows.items() if "error" in row]
    met = all(ratios[n] <= targets[n] for n in ratios) and not failed if len(ratios) == 2 else None
    result_line("strategies", primary, "<= 0.6" if primary is not None else None, met, ratios=ratios, failed=failed,
                presets=rows,
                devices=args.devices, cuda=cuda, num_params=params, batch_per_device=args.batch, short=args.short)


if __name__ == "__main__":
    main()
