"""The generative recipe, measured: the latent recipe from the encoder cache vs the VAE every step, the
text-to-image quickstart with a sample grid, and what the weight average (model.ema) costs.

1. latent: configs/latent_quickstart.yaml (a CNN on cached VAE latents) vs the same frozen VAE run on every
   step (configs/latent_on_the_fly.yaml), ``--epochs`` epochs each on ``--images`` demo shapes, steps/s after
   20 warm-up steps; the cache is built first by `lit-dist cache` (its time reported, not counted). Target
   >= 3x (as bench_cache's part 3, which also checks that both reach the same accuracy).
2. t2i: configs/t2i_quickstart.yaml (TinyUNet, flow matching, T5 caption cache) for ``--t2i-epochs``
   epochs: steps/s and the last training loss, then `lit-dist sample` of four prompts into ``--out``.
3. ema: steps/s of the quickstart's CNN (in-memory data, one process) with the average updated after every
   step vs without, ``--repeats`` runs each, alternating, medians: target >= 0.97. And the bytes of the
   average that rank 0 of 2 processes holds under FSDP2 vs DDP: target <= 0.55.

    .venv/bin/python -m benchmarks.bench_generative [--parts latent t2i ema] [--images 2000] [--epochs 3]
                                                    [--t2i-epochs 5] [--ema-steps 300] [--repeats 5] [--out DIR]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import ROOT, machine, result_line, run_bench

TIMER = ["--trainer.callbacks+=benchmarks.common.StepTimer", "--trainer.callbacks.warmup_steps", "20"]
PROMPTS = ("a red circle on a white background; a blue square on a yellow background; "
           "a green triangle on a black background; a white cross on a blue background")


def lit_dist(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "lit_dist", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"lit-dist {' '.join(args)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out


def latent(args, tmp: str, common: list[str]) -> dict:
    latent = ["--config", "configs/latent_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "latent-cache")]
    began = time.perf_counter()
    lit_dist("cache", *latent, *common)
    cache_s = time.perf_counter() - began
    steps = {}
    for name, extra in (("cache", []), ("on_the_fly", ["--config", "configs/latent_on_the_fly.yaml"])):
        r = run_bench([sys.executable, "-m", "lit_dist", "fit", *latent, *extra, *common, *TIMER,
                       "--trainer.max_epochs", str(args.epochs), "--run.run_id", name])
        steps[name] = r["steps_per_s"]
        print(f"latent {name:10s} {r['steps_per_s']:8.1f} steps/s", flush=True)
    ratio = steps["cache"] / steps["on_the_fly"]
    print(f"latent cache built in {cache_s:.1f} s; cache vs on the fly: {ratio:.2f}x (target >= 3)")
    return {"latent_ratio": round(ratio, 3), "latent_steps_per_s": steps, "latent_cache_build_s": round(cache_s, 1)}


def t2i(args, tmp: str, common: list[str]) -> dict:
    t2i = ["--config", "configs/t2i_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "t2i-cache")]
    lit_dist("cache", *t2i, *common)
    r = run_bench([sys.executable, "-m", "lit_dist", "fit", *t2i, *common, *TIMER, "--trainer.max_epochs",
                   str(args.t2i_epochs), "--run.run_id", "t2i", "--checkpoint.every_n_epochs", str(args.t2i_epochs)])
    run_dir = os.path.join(tmp, "runs", "t2i_quickstart", "t2i")
    os.makedirs(args.out, exist_ok=True)
    grid = os.path.join(args.out, "t2i-samples.png")
    began = time.perf_counter()
    sampled = lit_dist("sample", "--config", os.path.join(run_dir, "config.yaml"), "--checkpoint",
                       os.path.join(run_dir, "checkpoints"), "--prompt", PROMPTS, "--num", "6", "--steps", "30",
                       "--guidance", "4", "--output", grid)
    sample_s = time.perf_counter() - began
    report = lit_dist("report", run_dir).stdout
    loss = re.search(r"train/loss: last ([\d.e+-]+)", report)
    print(f"t2i quickstart {r['steps_per_s']:8.1f} steps/s, last train/loss {loss.group(1) if loss else '?'}; "
          f"{sampled.stdout.strip().splitlines()[-1]} in {sample_s:.1f} s (command included)")
    return {"t2i_steps_per_s": round(r["steps_per_s"], 2), "t2i_last_loss": float(loss.group(1)) if loss else None}


def ema(args, tmp: str) -> dict:
    """Steps/s with the average updated every step vs without (quickstart-scale CNN, in-memory data, one process,
    runs alternating, medians); the average's bytes on rank 0 of 2 processes under FSDP2 vs DDP."""
    base = [sys.executable, "-m", "lit_dist", "fit", "--config", "configs/quickstart.yaml", "--data",
            "benchmarks.common.InMemoryData", "--data.batch_size_per_device", "32", "--trainer.max_steps",
            str(args.ema_steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.enable_checkpointing", "false", "--export.filename", "null", "--trainer.log_every_n_steps", "50",
            "--run.root_dir", os.path.join(tmp, "ema-runs"), "--trainer.callbacks+=benchmarks.common.StepTimer",
            "--trainer.callbacks.warmup_steps", "20"]
    if not torch.cuda.is_available():
        base += ["--trainer.accelerator", "cpu"]
    with_ema = [*base, "--model.ema.decay", "0.999"]
    speed: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(args.repeats):
        for name, cmd in (("with", with_ema), ("without", base)) if i % 2 == 0 else (("without", base), ("with", with_ema)):
            speed[name].append(run_bench(cmd)["steps_per_s"])
    med = {k: statistics.median(v) for k, v in speed.items()}
    step_ratio = med["with"] / med["without"]
    print(f"EMA every step: {med['with']:.1f} vs {med['without']:.1f} steps/s without = {step_ratio:.3f} "
          f"(target >= 0.97; runs {speed})")
    held = {}
    for name, strategy in (("ddp", ["--trainer.strategy", "ddp"]), ("fsdp2", ["--config", "configs/fsdp2.yaml"])):
        r = run_bench([*with_ema, *strategy, "--trainer.devices", "2", "--trainer.max_steps", "25",
                       "--trainer.callbacks+=benchmarks.common.EMAMemory"])
        held[name] = r["ema_bytes"]
    memory_ratio = held["fsdp2"] / held["ddp"]
    print(f"EMA bytes on rank 0 of 2: FSDP2 {held['fsdp2']:,} vs DDP {held['ddp']:,} = {memory_ratio:.3f} (target <= 0.55)")
    return {"ema_step_ratio": round(step_ratio, 4), "ema_memory_ratio": round(memory_ratio, 4),
            "ema_steps_per_s": {k: round(v, 2) for k, v in med.items()}, "ema_bytes": held}


TARGETS = {"latent_ratio": (">=", 3.0), "ema_step_ratio": (">=", 0.97), "ema_memory_ratio": ("<=", 0.55)}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["latent", "t2i", "ema"], choices=["latent", "t2i", "ema"])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each latent run")
    parser.add_argument("--t2i-epochs", type=int, default=5)
    parser.add_argument("--ema-steps", type=int, default=300, help="steps of each EMA speed run")
    parser.add_argument("--repeats", type=int, default=5, help="EMA speed runs with and without, each")
    parser.add_argument("--out", default=".", help="where the sample grid is written (t2i-samples.png)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"machine: {machine()}; {device}; {args.images} demo shapes")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-")
    table = os.path.join(tmp, "shapes", "metadata.parquet")
    common = ["--data.metadata", table, "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "0", "--export.filename", "null", "--run.root_dir", os.path.join(tmp, "runs")]
    if not cuda:
        common += ["--trainer.accelerator", "cpu"]
    if {"latent", "t2i"} & set(args.parts):
        from lit_dist.data.demo import create_shapes_dataset

        create_shapes_dataset(table, num_images=args.images, seed=0)
    figures: dict = {}
    if "latent" in args.parts:
        figures |= latent(args, tmp, common)
    if "t2i" in args.parts:
        figures |= t2i(args, tmp, common)
    if "ema" in args.parts:
        figures |= ema(args, tmp)
    checks = {name: (value >= target if op == ">=" else value <= target)
              for name, (op, target) in TARGETS.items() if (value := figures.get(name)) is not None}
    primary = next((name for name in TARGETS if name in figures), None)
    result_line("generative", figures.get(primary), f"{TARGETS[primary][0]} {TARGETS[primary][1]}" if primary else None,
                all(checks.values()) if checks else None, primary=primary, checks=checks, device=device, **figures)


if __name__ == "__main__":
    main()
