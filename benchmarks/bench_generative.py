"""The generative recipe's speed on one device: the latent recipe's steps/s from the encoder cache vs the
VAE encoding every step, and the text-to-image quickstart's steps/s with a sample grid at the end.

1. latent: configs/latent_quickstart.yaml (a CNN on cached VAE latents) vs the same frozen VAE run on every
   step (configs/latent_on_the_fly.yaml), ``--epochs`` epochs each on ``--images`` demo shapes, steps/s after
   20 warm-up steps; the cache is built first by `lit-dist cache` (its time reported, not counted). Target
   >= 3x (as bench_cache's part 3, which also checks that both reach the same accuracy).
2. t2i: configs/t2i_quickstart.yaml (TinyUNet, flow matching, T5 caption cache) for ``--t2i-epochs``
   epochs: steps/s and the last training loss, then `lit-dist sample` of four prompts into ``--out``.

    .venv/bin/python -m benchmarks.bench_generative [--images 2000] [--epochs 3] [--t2i-epochs 5] [--out DIR]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import ROOT, machine, result_line, run_bench

PROMPTS = ("a red circle on a white background; a blue square on a yellow background; "
           "a green triangle on a black background; a white cross on a blue background")


def lit_dist(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "lit_dist", *args], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"lit-dist {' '.join(args)} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each latent run")
    parser.add_argument("--t2i-epochs", type=int, default=5)
    parser.add_argument("--out", default=".", help="where the sample grid is written (t2i-samples.png)")
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"machine: {machine()}; {device}; {args.images} demo shapes")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-")
    from lit_dist.data.demo import create_shapes_dataset

    table = os.path.join(tmp, "shapes", "metadata.parquet")
    create_shapes_dataset(table, num_images=args.images, seed=0)
    common = ["--data.metadata", table, "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "0", "--export.filename", "null", "--run.root_dir", os.path.join(tmp, "runs")]
    if not cuda:
        common += ["--trainer.accelerator", "cpu"]
    timer = ["--trainer.callbacks+=benchmarks.common.StepTimer", "--trainer.callbacks.warmup_steps", "20"]

    latent = ["--config", "configs/latent_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "latent-cache")]
    began = time.perf_counter()
    lit_dist("cache", *latent, *common)
    cache_s = time.perf_counter() - began
    steps = {}
    for name, extra in (("cache", []), ("on_the_fly", ["--config", "configs/latent_on_the_fly.yaml"])):
        r = run_bench([sys.executable, "-m", "lit_dist", "fit", *latent, *extra, *common, *timer,
                       "--trainer.max_epochs", str(args.epochs), "--run.run_id", name])
        steps[name] = r["steps_per_s"]
        print(f"latent {name:10s} {r['steps_per_s']:8.1f} steps/s", flush=True)
    ratio = steps["cache"] / steps["on_the_fly"]
    print(f"latent cache built in {cache_s:.1f} s; cache vs on the fly: {ratio:.2f}x (target >= 3)")

    t2i = ["--config", "configs/t2i_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "t2i-cache")]
    lit_dist("cache", *t2i, *common)
    r = run_bench([sys.executable, "-m", "lit_dist", "fit", *t2i, *common, *timer, "--trainer.max_epochs",
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
    result_line("generative", round(ratio, 3), ">= 3", ratio >= 3, device=device, latent_steps_per_s=steps,
                latent_cache_build_s=round(cache_s, 1), t2i_steps_per_s=round(r["steps_per_s"], 2),
                t2i_last_loss=float(loss.group(1)) if loss else None, images=args.images, epochs=args.epochs)


if __name__ == "__main__":
    main()
