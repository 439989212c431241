"""A LoRA on a pretrained pipeline's U-Net, measured against diffusers' own LoRA training loop, and its checkpoint
against a full fine-tune's.

The SDXL-shaped pipeline folder of bench_pipeline (random weights, written with save_pretrained, loaded by path) and
the demo shapes. lit-dist trains ``model.adapter`` (LoRA, rank ``--rank``, alpha = rank, gaussian init, on the
attention projections); the baseline is benchmarks/diffusers_loop.py ``--lora-rank``, written as diffusers'
train_dreambooth_lora_sdxl.py (accelerate, peft's ``add_adapter`` on the same layers with the same rank, alpha and
init, the latents and caption encodings precomputed in memory). Same data, batch, resolution and precision;
validation and samples off.

1. step: steps/s after ``--warmup-steps``, medians of ``--repeats`` interleaved rounds (lit-dist reads the cache the
   first round built): lit-dist's over the baseline's, target >= 1.0.
2. checkpoint: the bytes of the checkpoint a LoRA run saves at its end against a full fine-tune's of the same model
   (both with their optimizer state and weight average), over the share of the U-Net's parameters the LoRA trains:
   target <= 1.2 (the checkpoint holds the adapter, not the base).
3. FSDP2 against DDP, the same LoRA run on 2 processes: per-rank bytes of parameters, gradients and optimizer state
   at the optimizer step (benchmarks.common.StateMemory; under FSDP2 the frozen base is sharded), target <= 0.6;
   and steps/s (medians of ``--repeats``), target >= 0.8: the base is gathered block by block for the forward
   and the backward, where DDP only all-reduces the adapter's gradients.

    .venv/bin/python -m benchmarks.bench_lora [--rank 8] [--steps 60] [--repeats 5] [--short]
"""

import argparse
import os
import shutil
import statistics
import tempfile

import torch

from benchmarks.bench_pipeline import add_arguments, baseline_run, lit_dist_run, shorten, write_pipeline
from benchmarks.common import checks, machine, result_line

TARGETS = {"step_ratio": (">=", 1.0), "checkpoint_ratio": ("<=", 1.2), "fsdp2_memory_ratio": ("<=", 0.6),
           "fsdp2_step_ratio": (">=", 0.8)}
STRATEGIES = {"ddp": ["--trainer.strategy", "ddp"],
              "fsdp2": ["--trainer.strategy", '{"class_path": "lit_dist.strategies.fsdp.FSDP2Strategy"}']}


def adapter_args(rank: int) -> list[str]:
    return ["--model.adapter.kind", "lora", "--model.adapter.rank", str(rank), "--model.adapter.init", "gaussian"]


def checkpoint_bytes(run_dir: str) -> int:
    """Bytes of the newest checkpoint folder of a run (every file in it)."""
    folder = os.path.join(run_dir, "checkpoints")
    newest = max(name for name in os.listdir(folder) if name.startswith("step-"))
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(folder, newest))
               for f in files)


def trainable_share(folder: str, rank: int) -> tuple[int, int]:
    """(parameters the LoRA trains, parameters of the U-Net without it)."""
    from lit_dist.model.adapters import Adapter
    from lit_dist.model.nets.pipeline import PipelineDenoiser

    net = PipelineDenoiser(folder)
    total = sum(p.numel() for p in net.parameters())
    Adapter(kind="lora", rank=rank, init="gaussian").attach(net)
    return sum(p.numel() for p in net.parameters() if p.requires_grad), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, repeats=5)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    if args.short:
        shorten(args)
        args.rank = 4
    print(f"machine: {machine()}; U-Net levels {args.channels}, LoRA rank {args.rank}, batch {args.batch}, "
          f"{args.resolution} pixels, {args.images} demo shapes")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-lora-")
    folder, table = os.path.join(tmp, "sdxl"), os.path.join(tmp, "shapes", "metadata.parquet")
    from lit_dist.data.demo.shapes import create_shapes_dataset

    create_shapes_dataset(table, num_images=args.images, seed=0)
    write_pipeline(folder, tuple(args.channels))
    cache, runs = os.path.join(tmp, "cache"), os.path.join(tmp, "runs")

    ours, base = [], []
    for i in range(args.repeats):  # interleaved: what else runs on the machine slows both alike
        ours.append(lit_dist_run(args, folder, table, cache, runs, f"lora{i}", *adapter_args(args.rank)))
        base.append(baseline_run(args, folder, table, "--lora-rank", str(args.rank)))
    # The checkpoints: the same short run with a LoRA and without, each saving at its end.
    saved = {}
    for name, extra in (("lora", adapter_args(args.rank)), ("full", [])):
        short = argparse.Namespace(**{**vars(args), "steps": args.warmup_steps + 2})
        lit_dist_run(short, folder, table, cache, runs, f"ckpt-{name}", *extra, "--checkpoint.save_last", "true",
                     "--run.name", "bench")
        saved[name] = checkpoint_bytes(os.path.join(runs, "bench", f"ckpt-{name}"))
    # FSDP2 against DDP on 2 processes, interleaved rounds.
    two = {name: [] for name in STRATEGIES}
    for i in range(args.repeats):
        for name, strategy in STRATEGIES.items():
            two[name].append(lit_dist_run(args, folder, table, cache, runs, f"{name}{i}", *adapter_args(args.rank),
                                          "--trainer.devices", "2", *strategy,
                                          "--trainer.callbacks+=benchmarks.common.StateMemory"))
    trained, total = trainable_share(folder, args.rank)
    share = trained / total
    speed = {side: statistics.median(run["steps_per_s"] for run in runs_) for side, runs_ in (("ours", ours),
                                                                                              ("base", base))}
    figures = {
        "step_ratio": speed["ours"] / speed["base"],
        "checkpoint_ratio": saved["lora"] / saved["full"] / share,
        "lit_dist_steps_per_s": [run["steps_per_s"] for run in ours],
        "baseline_steps_per_s": [run["steps_per_s"] for run in base],
        "lora_checkpoint_bytes": saved["lora"], "full_checkpoint_bytes": saved["full"],
        "trained_parameters": trained, "unet_parameters": total,
        "fsdp2_memory_ratio": two["fsdp2"][0]["total"] / two["ddp"][0]["total"],
        "fsdp2_step_ratio": statistics.median(r["steps_per_s"] for r in two["fsdp2"]) /
        statistics.median(r["steps_per_s"] for r in two["ddp"]),
        "ddp_rank_bytes": two["ddp"][0]["total"], "fsdp2_rank_bytes": two["fsdp2"][0]["total"],
        "ddp_steps_per_s": [r["steps_per_s"] for r in two["ddp"]],
        "fsdp2_steps_per_s": [r["steps_per_s"] for r in two["fsdp2"]],
    }
    print(f"step: lit-dist {speed['ours']:.3f} steps/s, diffusers' LoRA loop {speed['base']:.3f} "
          f"(x{figures['step_ratio']:.3f}, medians of {args.repeats}); checkpoint: LoRA {saved['lora']:,} bytes, "
          f"full fine-tune {saved['full']:,} ({saved['lora'] / saved['full']:.4f} of it) for {share:.4f} of the "
          f"parameters trained (x{figures['checkpoint_ratio']:.3f})")
    print(f"2 processes: per rank FSDP2 {figures['fsdp2_rank_bytes'] / 2**20:.1f} MiB, DDP "
          f"{figures['ddp_rank_bytes'] / 2**20:.1f} MiB (x{figures['fsdp2_memory_ratio']:.3f}); steps/s FSDP2 "
          f"{figures['fsdp2_steps_per_s']}, DDP {figures['ddp_steps_per_s']} (x{figures['fsdp2_step_ratio']:.3f})")
    shutil.rmtree(tmp, ignore_errors=True)
    met = checks(figures, TARGETS)
    result_line("lora", figures["step_ratio"], ">= 1.0", all(met.values()), checks=met, machine=machine(),
                **figures, short=args.short)


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
