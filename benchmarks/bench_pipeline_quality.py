"""Weights that really come from a pipeline folder: a fine-tune of a pipeline that draws the shapes keeps drawing them.

1. judge: the classification quickstart, trained here; its model.pt judges samples (ShapesJudge: the prompt's shape
   and both colours).
2. VAE: a tiny ``AutoencoderKL`` (latents 2x smaller a side, 4 channels) trained on the demo shapes by a plain loop,
   its ``scaling_factor`` set so that latents have unit variance; reported: the judge's score on its
   reconstructions of validation images (what a perfect denoiser could reach).
3. pretrain: a Stable Diffusion 1.5 pipeline folder (the tests' tiny CLIP text encoder and tokenizer, that VAE, a
   ``UNet2DConditionModel`` of ``--channels`` levels with random weights, DDIM over SD's noise schedule rescaled to
   zero terminal SNR, v-prediction) trained with min-SNR weighting by `lit-dist fit --pipeline.path` until it draws
   the shapes, then written as a folder with its weight average (`lit-dist export --ema true`): the pretrained
   pipeline.
4. fine-tune: `lit-dist fit --pipeline.path` from that folder for ``--finetune-steps``, its samples scored at each
   validation: every one >= 0.8 (target), against the same run from the random base folder (near 0).

    .venv/bin/python -m benchmarks.bench_pipeline_quality [--images 3000] [--pretrain-steps 4000] [--short]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from benchmarks.common import SHORT_HELP, lit_dist, machine, result_line, run_bench

TARGET = 0.8
JUDGE = "lit_dist.data.demo.judge.ShapesJudge"


def train_judge(tmp: str, table: str, epochs: int | None) -> str:
    """The quickstart classifier's model.pt, trained on ``table``."""
    extra = [] if epochs is None else ["--trainer.max_epochs", str(epochs)]
    lit_dist("fit", "--config", "configs/quickstart.yaml", "--data.metadata", table, "--trainer.accelerator", "cpu",
             "--trainer.devices", "1", "--trainer.enable_progress_bar", "false", "--data.allow_oversubscription",
             "true", "--export.filename", "model.pt", "--run.root_dir", os.path.join(tmp, "runs"), "--run.run_id",
             "judge", *extra)
    return os.path.join(tmp, "runs", "quickstart", "judge", "model.pt")


def shapes_tensor(table: str, split: str, limit: int) -> tuple[torch.Tensor, list[str]]:
    """Up to ``limit`` images of ``split`` as (N, 3, 32, 32) uint8, with their captions."""
    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    rows = pq.read_table(table).to_pylist()
    rows = [r for r in rows if r.get("split", "train") == split][:limit]
    root = os.path.dirname(table)
    images = np.stack([np.asarray(Image.open(os.path.join(root, r["filename"])).convert("RGB").resize((32, 32)))
                       for r in rows])
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), [r["caption"] for r in rows]


def train_vae(table: str, steps: int, seed: int = 0):
    """A tiny AutoencoderKL fitted to the shapes (reconstruction, and a little KL so that latents stay near a
    normal), its scaling_factor set from its latents' spread."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    images, _ = shapes_tensor(table, "train", 100_000)
    x_all = images.float() / 127.5 - 1
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                        latent_channels=4, norm_num_groups=16, sample_size=32, mid_block_add_attention=False)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3)
    # Decayed to nothing: at a constant 2e-3 the loss jumped ten-fold late in the run and the reconstructions lost
    # their colours.
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = x_all[torch.randint(len(x_all), (32,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        loss = torch.nn.functional.mse_loss(vae.decode(posterior.sample(generator)).sample, x) \
            + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"vae step {step}: loss {loss.item():.4f}", flush=True)
    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(x_all[i:i + 256]).latent_dist.mean for i in range(0, min(len(x_all), 1024), 256)])
    vae.register_to_config(scaling_factor=float(1 / latents.std()))
    return vae


def judged_reconstructions(vae, table: str, judge_path: str) -> float:
    """ShapesJudge's score on the VAE's reconstructions of validation images: the ceiling its latents allow."""
    from lit_dist.data.demo.judge import ShapesJudge

    images, captions = shapes_tensor(table, "val", 256)
    with torch.no_grad():
        x = images.float() / 127.5 - 1
        back = vae.decode(vae.encode(x).latent_dist.mean).sample
    pixels = ((back.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return float(ShapesJudge(judge_path)(pixels, captions).float().mean())


def write_base(folder: str, vae, channels: tuple[int, ...], seed: int = 0) -> None:
    """An SD 1.5 folder: the tests' tiny CLIP text encoder and tokenizer, ``vae``, a random U-Net of ``channels``
    levels and DDIM over SD's scaled-linear schedule."""
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from tests.helpers.pipelines import save_pipeline

    save_pipeline("sd15", folder, seed=seed)
    torch.manual_seed(seed)
    levels = len(channels)
    unet = UNet2DConditionModel(
        block_out_channels=channels, layers_per_block=2, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (levels - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (levels - 1) + ("UpBlock2D",), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=16)
    for name, part in (("unet", unet), ("vae", vae)):
        shutil.rmtree(os.path.join(folder, name))
        part.save_pretrained(os.path.join(folder, name), safe_serialization=True)
    shutil.rmtree(os.path.join(folder, "scheduler"))
    # SD's schedule with zero terminal SNR, v-prediction and trailing steps (Lin et al. 2023, as SD 2.x fine-tunes
    # use it): SD's own schedule leaves 7 % of the image in its last step, which at 16 x 16 latents is the
    # background's colour: a model learns to read it there instead of from the caption, and draws from pure
    # noise with the two colours of a caption swapped half the time (the first version of this benchmark).
    DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, num_train_timesteps=1000,
                  clip_sample=False, set_alpha_to_one=False, prediction_type="v_prediction",
                  rescale_betas_zero_snr=True, timestep_spacing="trailing").save_pretrained(
        os.path.join(folder, "scheduler"))
    index_path = os.path.join(folder, "model_index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["scheduler"] = ["diffusers", "DDIMScheduler"]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)


def fit(args, folder: str, table: str, tmp: str, run_id: str, steps: int, every: int, judge: str, lr: float,
        *extra: str) -> dict:
    """A `lit-dist fit --pipeline.path` run; its samples' adherence at each validation (BENCH lines)."""
    return run_bench([
        sys.executable, "-m", "lit_dist", "fit", "--pipeline.path", folder, "--data.metadata", table,
        "--data.resolution", "32", "--data.batch_size_per_device", str(args.batch), "--data.num_workers", "1",
        "--data.allow_oversubscription", "true", "--data.cache.dir", os.path.join(tmp, "cache"),
        "--model.optimizer.init_args.lr", str(lr), "--model.warmup_steps", str(min(100, steps // 10)),
        "--model.objective", "lit_dist.model.objectives.Diffusion", "--model.objective.init_args.condition_dropout",
        "0.1", "--model.objective.init_args.snr_gamma", "5",
        "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
        "--trainer.check_val_every_n_epoch", "null", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu" if not torch.cuda.is_available() else "auto", "--trainer.devices", "1",
        "--samples.num_prompts", str(args.prompts), "--samples.per_prompt", "4", "--samples.steps",
        str(args.sample_steps), "--samples.guidance", "4", "--samples.judge", JUDGE,
        "--samples.judge.classifier", judge, "--export.filename", "null",
        "--checkpoint.every_n_epochs", "null", "--checkpoint.every_n_steps", str(steps),
        "--run.root_dir", os.path.join(tmp, "runs"), "--run.name", "quality", "--run.run_id", run_id,
        "--trainer.callbacks+=benchmarks.common.SamplingTime", *extra])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The judge, VAE, base folder and pretraining of a quality run (this benchmark's, and bench_lora_quality's)."""
    parser.add_argument("--images", type=int, default=3000, help="demo shapes (the quickstarts' 3,000)")
    parser.add_argument("--vae-steps", type=int, default=1500, help="steps of the VAE's training, batch 32")
    parser.add_argument("--pretrain-steps", type=int, default=4000, help="steps of the pretraining run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--channels", type=int, nargs="+", default=[32, 64, 128], help="the U-Net's levels")
    parser.add_argument("--prompts", type=int, default=8, help="validation captions per grid (4 images each)")
    parser.add_argument("--sample-steps", type=int, default=25, help="DDIM steps of each grid")
    parser.add_argument("--judge", help="the quickstart classifier's model.pt; default: train it here (about a minute)")
    parser.add_argument("--judge-epochs", type=int, help="epochs of the judge's training (default: the quickstart's)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)


def shorten(args: argparse.Namespace) -> None:
    """--short: every part at tiny sizes."""
    args.images, args.vae_steps, args.pretrain_steps = 160, 2, 4
    args.batch, args.channels, args.prompts, args.sample_steps, args.judge_epochs = 8, [16, 32], 2, 2, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--finetune-steps", type=int, default=200, help="steps of each fine-tuning run")
    parser.add_argument("--every", type=int, default=50, help="fine-tuning steps between validations (samples)")
    args = parser.parse_args()
    if args.short:
        shorten(args)
        args.finetune_steps, args.every = 4, 2
    print(f"machine: {machine()}; {args.images} demo shapes; U-Net levels {args.channels}, batch {args.batch}")
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-quality-")
    try:
        figures = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    met = figures["finetuned_min"] >= TARGET
    result_line("pipeline_quality", figures["finetuned_min"], f">= {TARGET}", met, machine=machine(), **figures,
                short=args.short)


def run(args, tmp: str) -> dict:
    from lit_dist.data.demo.shapes import create_shapes_dataset

    table = os.path.join(tmp, "shapes", "metadata.parquet")
    create_shapes_dataset(table, num_images=args.images, seed=0)
    judge = args.judge or train_judge(tmp, table, args.judge_epochs)
    vae = train_vae(table, args.vae_steps)
    ceiling = judged_reconstructions(vae, table, judge)
    print(f"vae: the judge's score on its reconstructions {ceiling:.3f}", flush=True)
    base = os.path.join(tmp, "base")
    write_base(base, vae, tuple(args.channels))

    began = time.perf_counter()
    pretrain = fit(args, base, table, tmp, "pretrain", args.pretrain_steps, max(1, args.pretrain_steps // 4), judge,
                   1e-3, "--model.ema.decay", "0.999")
    print(f"pretrain: {args.pretrain_steps} steps in {time.perf_counter() - began:.0f} s; its grids' adherence "
          f"{pretrain['adherence']}", flush=True)
    pretrained = os.path.join(tmp, "pretrained")
    out = lit_dist("export", os.path.join(tmp, "runs", "quality", "pretrain", "checkpoints"), "--ema", "true",
                   "--output", pretrained)
    print(out.stdout.strip().splitlines()[-1], flush=True)

    finetuned = fit(args, pretrained, table, tmp, "finetune", args.finetune_steps, args.every, judge, 1e-4)
    scratch = fit(args, base, table, tmp, "scratch", args.finetune_steps, args.every, judge, 1e-4)
    print(f"fine-tune from the pretrained folder: adherence at each validation {finetuned['adherence']} (target >= "
          f"{TARGET} each); the same from the random base folder {scratch['adherence']}", flush=True)
    return {"finetuned_min": min(finetuned["adherence"]), "finetuned": finetuned["adherence"],
            "from_random": scratch["adherence"], "pretrain_adherence": pretrain["adherence"],
            "vae_ceiling": round(ceiling, 3)}


if __name__ == "__main__":
    main()
