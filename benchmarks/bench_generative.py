"""The generative recipe, measured: the latent recipe from the encoder cache vs the VAE every step, the
text-to-image quickstart with a sample grid, and what the weight average (model.ema) costs.

1. latent: configs/latent_quickstart.yaml (a CNN on cached VAE latents) vs the same frozen VAE run on every
   step (configs/latent_on_the_fly.yaml), ``--epochs`` epochs each on ``--images`` demo shapes, steps/s after
   20 warm-up steps; the cache is built first by `lit-dist cache` (its time reported, not counted). Target
   >= 3x (as bench_cache's part 3, which also checks that both reach the same accuracy).
2. t2i: configs/t2i_quickstart.yaml (TinyUNet, flow matching, T5 caption cache, model.ema at decay 0.999) for
   ``--t2i-epochs`` epochs (60: 4,980 steps): steps/s and the last training loss. Then prompt adherence
   (lit_dist.data.demo.judge.ShapesJudge, with the classification quickstart trained first as its classifier):
   `lit-dist sample` of 32 validation captions x 4 images (128 per seed: with 64, one image is 1.6 points), 30
   steps, guidance 4, seeds 0 and 1, with the average and with the raw weights; the figure is the lower seed's.
   Target >= 0.8 with the average on each seed, and the average not below the raw weights.
3. sampling: grids of 8 prompts x 8 images (30 steps, guidance 4) during a t2i run on 1 process vs 2, one thread
   each, a grid after each of 4 training steps; the first also encodes the prompts, so the median of the other
   three: target >= 1.7x.
4. ema: steps/s of the quickstart's CNN (in-memory data, one process) with the average updated after every
   step vs without, ``--repeats`` runs each, alternating, medians: target >= 0.97. And the bytes of the
   average that rank 0 of 2 processes holds under FSDP2 (its shards) vs DDP (a whole copy): target <= 0.55.

    .venv/bin/python -m benchmarks.bench_generative [--parts latent t2i sampling ema] [--images 3000] [--epochs 3]
                                                    [--t2i-epochs 60] [--ema-steps 300] [--repeats 5] [--out DIR]
                                                    [--short]
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.common import SHORT_HELP, checks, lit_dist, machine, result_line, run_bench

PROMPTS = ("a red circle on a white background; a blue square on a yellow background; "
           "a green triangle on a black background; a white cross on a blue background")


def timer(args) -> list[str]:
    """The arguments that add StepTimer to a run: steps/s after ``--warmup-steps``."""
    return ["--trainer.callbacks+=benchmarks.common.StepTimer",
            "--trainer.callbacks.warmup_steps", str(args.warmup_steps)]


def latent(args, tmp: str, common: list[str]) -> dict:
    latent = ["--config", "configs/latent_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "latent-cache")]
    began = time.perf_counter()
    lit_dist("cache", *latent, *common)
    cache_s = time.perf_counter() - began
    steps = {}
    for name, extra in (("cache", []), ("on_the_fly", ["--config", "configs/latent_on_the_fly.yaml"])):
        r = run_bench([sys.executable, "-m", "lit_dist", "fit", *latent, *extra, *common, *timer(args),
                       "--trainer.max_epochs", str(args.epochs), "--run.run_id", name])
        steps[name] = r["steps_per_s"]
        print(f"latent {name:10s} {r['steps_per_s']:8.1f} steps/s", flush=True)
    ratio = steps["cache"] / steps["on_the_fly"]
    print(f"latent cache built in {cache_s:.1f} s; cache vs on the fly: {ratio:.2f}x (target >= 3)")
    return {"latent_ratio": round(ratio, 3), "latent_steps_per_s": steps, "latent_cache_build_s": round(cache_s, 1)}


def t2i(args, tmp: str, common: list[str]) -> dict:
    """Train the t2i quickstart; score its samples with the quickstart classifier (EMA and raw weights, two seeds)."""
    judge = args.judge or train_judge(args, tmp, common)
    scored = ["--samples.judge", "lit_dist.data.demo.judge.ShapesJudge", "--samples.judge.classifier", judge]
    grids = [] if args.t2i_grid_steps is None else ["--samples.steps", str(args.t2i_grid_steps)]
    t2i = t2i_cached(tmp, common)
    began = time.perf_counter()
    r = run_bench([sys.executable, "-m", "lit_dist", "fit", *t2i, *common, *timer(args), *scored,
                   "--trainer.max_epochs", str(args.t2i_epochs), "--run.run_id", "t2i",
                   "--checkpoint.every_n_epochs", str(args.t2i_epochs),
                   "--trainer.callbacks+=benchmarks.common.SamplingTime", *grids])
    fit_s = time.perf_counter() - began
    run_dir = os.path.join(tmp, "runs", "t2i_quickstart", "t2i")
    report = lit_dist("report", run_dir).stdout
    loss = re.search(r"train/loss: last ([\d.e+-]+)", report)
    print(f"t2i quickstart: {args.t2i_epochs} epochs in {fit_s:.0f} s, {r['steps_per_s']:.1f} steps/s, last train/loss "
          f"{loss.group(1) if loss else '?'}; its own grids' adherence {r['adherence']} in {r['sampling_s']} s")

    # Adherence: --prompts (32) validation captions x 4 images, through `lit-dist sample`, as a user would score one.
    prompts = "; ".join(validation_captions(common, args.prompts))
    adherence: dict[str, list[float]] = {"ema": [], "raw": []}
    os.makedirs(args.out, exist_ok=True)
    for seed in range(args.seeds):
        for weights in ("ema", "raw"):
            grid = os.path.join(args.out, f"t2i-{weights}-seed{seed}.png")
            out = lit_dist("sample", "--config", os.path.join(run_dir, "config.yaml"), "--checkpoint",
                           os.path.join(run_dir, "checkpoints"), "--prompt", prompts, "--num", "4",
                           "--steps", str(args.sample_steps), "--guidance", "4", "--seed", str(seed),
                           "--ema", str(weights == "ema").lower(), "--output", grid, *scored).stdout
            adherence[weights].append(float(re.search(r"adherence ([\d.]+)", out).group(1)))
            print(f"adherence, {weights} weights, seed {seed}: {adherence[weights][-1]:.3f} -> {grid}", flush=True)
    worst_ema = min(adherence["ema"])
    ema_not_worse = all(e >= r for e, r in zip(adherence["ema"], adherence["raw"], strict=True))
    print(f"adherence with EMA {adherence['ema']} (target >= 0.8 each), raw {adherence['raw']}: EMA >= raw "
          f"{'on both seeds' if ema_not_worse else 'NOT on both seeds'}")
    return {"t2i_steps_per_s": round(r["steps_per_s"], 2), "t2i_last_loss": float(loss.group(1)) if loss else None,
            "adherence_ema": worst_ema, "adherence": adherence, "ema_not_worse": ema_not_worse}


def sampling(args, tmp: str, common: list[str]) -> dict:
    """Grids of 8 prompts x 8 images (30 steps, guidance 4) during a t2i run, one after each of 4 steps, on 1
    process and on 2 (one thread each: this VM has 2 cores, a process per core as a GPU per rank). The first grid
    of a run also encodes the prompts: the median of the other three. The weights do not change the cost."""
    t2i = t2i_cached(tmp, common)
    seconds, runs = {}, {}
    for devices in (1, 2):
        cmd = [sys.executable, "-m", "lit_dist", "fit", *t2i, *common, "--trainer.devices", str(devices),
               "--trainer.max_steps", "4", "--samples.every_n_steps", "1", "--samples.at_end", "false",
               "--samples.num_prompts", str(args.grid), "--samples.per_prompt", str(args.grid),
               "--samples.steps", str(args.sample_steps),
               "--samples.batch_size", "16", "--samples.judge", "null", "--run.run_id", f"sampling-{devices}",
               "--trainer.callbacks+=benchmarks.common.SamplingTime"]
        if devices == 2:
            cmd += ["--trainer.strategy", "ddp"]
        runs[devices] = run_bench(cmd, env={"OMP_NUM_THREADS": "1"})["sampling_s"]
        seconds[devices] = statistics.median(runs[devices][1:])
        print(f"a grid of {args.grid ** 2} images on {devices} process(es): {seconds[devices]:.2f} s "
              f"(grids: {runs[devices]})", flush=True)
    speedup = seconds[1] / seconds[2]
    print(f"sampling 2 processes vs 1: {speedup:.2f}x (target >= 1.7)")
    return {"sampling_speedup": round(speedup, 3), "sampling_s": seconds, "sampling_grids_s": runs}


def t2i_cached(tmp: str, common: list[str]) -> list[str]:
    """The t2i quickstart's arguments, its caption cache in ``tmp`` built by `lit-dist cache` the first time."""
    t2i = ["--config", "configs/t2i_quickstart.yaml", "--data.cache.dir", os.path.join(tmp, "t2i-cache")]
    if not os.path.isdir(os.path.join(tmp, "t2i-cache")):
        lit_dist("cache", *t2i, *common)
    return t2i


def train_judge(args, tmp: str, common: list[str]) -> str:
    """The classification quickstart, trained once: its model.pt judges the samples (lit_dist.model.judge)."""
    began = time.perf_counter()
    epochs = [] if args.judge_epochs is None else ["--trainer.max_epochs", str(args.judge_epochs)]
    out = lit_dist("fit", "--config", "configs/quickstart.yaml", *common, *epochs, "--trainer.limit_val_batches", "1.0",
                   "--export.filename", "model.pt",
                   "--run.run_id", "judge")
    acc = re.findall(r"val/acc ([\d.]+)", out.stdout + out.stderr)
    print(f"judge: the quickstart classifier in {time.perf_counter() - began:.0f} s, val/acc "
          f"{acc[-1] if acc else '?'}", flush=True)
    return os.path.join(tmp, "runs", "quickstart", "judge", "model.pt")


def validation_captions(common: list[str], n: int) -> list[str]:
    """``n`` distinct captions of the demo table's validation rows, chosen by a fixed seed."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(common[common.index("--data.metadata") + 1], columns=["caption", "split"])
    captions = sorted({c for c, s in zip(table["caption"].to_pylist(), table["split"].to_pylist(), strict=True)
                       if s == "val"})
    return [captions[i] for i in np.random.default_rng(0).choice(len(captions), size=n, replace=False)]


def ema(args, tmp: str) -> dict:
    """Steps/s with the average updated every step vs without (quickstart-scale CNN, in-memory data, one process,
    runs alternating, medians); the average's bytes on rank 0 of 2 processes under FSDP2 vs DDP."""
    base = [sys.executable, "-m", "lit_dist", "fit", "--config", "configs/quickstart.yaml", "--data",
            "benchmarks.common.InMemoryData", "--data.batch_size_per_device", "32", "--trainer.max_steps",
            str(args.ema_steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.enable_checkpointing", "false", "--export.filename", "null", "--trainer.log_every_n_steps", "50",
            "--run.root_dir", os.path.join(tmp, "ema-runs"), *timer(args)]
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
        r = run_bench([*with_ema, *strategy, "--trainer.devices", "2",
                       "--trainer.max_steps", str(args.warmup_steps + 5),
                       "--trainer.callbacks+=benchmarks.common.EMAMemory"])
        held[name] = r["ema_bytes"]
    memory_ratio = held["fsdp2"] / held["ddp"]
    print(f"EMA bytes on rank 0 of 2: FSDP2 {held['fsdp2']:,} vs DDP {held['ddp']:,} = {memory_ratio:.3f} (target <= 0.55)")
    return {"ema_step_ratio": round(step_ratio, 4), "ema_memory_ratio": round(memory_ratio, 4),
            "ema_steps_per_s": {k: round(v, 2) for k, v in med.items()}, "ema_bytes": held}


TARGETS = {"latent_ratio": (">=", 3.0), "adherence_ema": (">=", 0.8), "sampling_speedup": (">=", 1.7),
           "ema_step_ratio": (">=", 0.97), "ema_memory_ratio": ("<=", 0.55)}


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ["latent", "t2i", "sampling", "ema"]
    parser.add_argument("--parts", nargs="+", default=parts, choices=parts)
    parser.add_argument("--images", type=int, default=3000, help="demo shapes (the quickstarts' 3,000)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each latent run")
    parser.add_argument("--t2i-epochs", type=int, default=60, help="epochs of the t2i run (its config's 60)")
    parser.add_argument("--judge", help="the quickstart classifier's model.pt; default: train it here (about a minute)")
    parser.add_argument("--ema-steps", type=int, default=300, help="steps of each EMA speed run")
    parser.add_argument("--repeats", type=int, default=5, help="EMA speed runs with and without, each")
    parser.add_argument("--out", help="where the adherence grids are written (t2i-WEIGHTS-seedN.png; default: here, "
                                      "with --short a temporary folder)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps before steps/s is timed, in every run")
    parser.add_argument("--judge-epochs", type=int, help="epochs of the judge's training (default: the quickstart's)")
    parser.add_argument("--prompts", type=int, default=32, help="validation captions for the adherence (4 images each)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the adherence's samples")
    parser.add_argument("--sample-steps", type=int, default=30, help="denoising steps of adherence and sampling grids")
    parser.add_argument("--t2i-grid-steps", type=int,
                        help="denoising steps of the t2i run's own grids (default: its config's)")
    parser.add_argument("--grid", type=int, default=8, help="the sampling part's grid: prompts, and images per prompt")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # every part; the sampling part's median needs its 4 steps
        args.images, args.epochs, args.t2i_epochs, args.judge_epochs, args.warmup_steps = 160, 1, 1, 1, 2
        args.ema_steps, args.repeats, args.prompts, args.seeds, args.sample_steps, args.grid = 12, 1, 2, 1, 2, 2
        args.t2i_grid_steps = 2
        args.out = args.out or tempfile.mkdtemp(prefix="lit-dist-bench-grids-")
    args.out = args.out or "."
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"machine: {machine()}; {device}; {args.images} demo shapes")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-")
    table = os.path.join(tmp, "shapes", "metadata.parquet")
    # Oversubscription: a short run's few images leave a bucket under one batch (3,000 leave none).
    common = ["--data.metadata", table, "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "0", "--export.filename", "null", "--data.allow_oversubscription", "true",
              "--run.root_dir", os.path.join(tmp, "runs")]
    if not cuda:
        common += ["--trainer.accelerator", "cpu"]
    if {"latent", "t2i", "sampling"} & set(args.parts):
        from lit_dist.data.demo.shapes import create_shapes_dataset

        create_shapes_dataset(table, num_images=args.images, seed=0)
    figures: dict = {}
    if "latent" in args.parts:
        figures |= latent(args, tmp, common)
    if "t2i" in args.parts:
        figures |= t2i(args, tmp, common)
    if "sampling" in args.parts:
        figures |= sampling(args, tmp, common)
    if "ema" in args.parts:
        figures |= ema(args, tmp)
    met = checks(figures, TARGETS)
    if "ema_not_worse" in figures:
        met["ema_not_worse"] = figures["ema_not_worse"]
    primary = next((name for name in TARGETS if name in figures), None)
    result_line("generative", figures.get(primary), f"{TARGETS[primary][0]} {TARGETS[primary][1]}" if primary else None,
                all(met.values()) if met else None, primary=primary, checks=met, device=device, **figures,
                short=args.short)


if __name__ == "__main__":
    main()
