"""The ``pipeline`` group: one key names a pretrained diffusers pipeline folder, and the run config follows from it.

    pipeline:
      path: /models/stable-diffusion-xl-base-1.0    # what `huggingface-cli download ... --local-dir` wrote, or a hub id
      gradient_checkpointing: true
    data:
      metadata: /data/photos.parquet
      cache: {dir: /scratch/caches/photos-sdxl}

Before any class is built, ``fill`` sets from the folder what a fine-tune of it needs, so that the config says
only what is the user's choice:

- ``model.net``: the folder's denoiser (``PipelineDenoiser``), with ``gradient_checkpointing`` and ``guidance``;
- ``model.objective``: the family's, with the schedule its ``scheduler/`` was trained with: ``Diffusion``
  (prediction type, beta schedule, betas, steps) for SD 1.5/2.x, SDXL and PixArt; ``FlowMatching`` (constant shift,
  or the shift by token count) for SD3 and Flux. Whatever else the config gives it (``condition_dropout``,
  ``timesteps``, ``snr_gamma``, ...) stays;
- ``model.input_key``: the cached latents (``data.cache.encoder_key``);
- ``data.cache.encoder``: the folder's VAE (``VAEEncoder``); ``data.cache.caption_encoder``: its text encoders
  (``PipelineTextEncoder``, with ``max_length``); ``data.cache.pixels: false`` (the model reads latents);
- ``data.cache.compute_dtype`` where it is auto: bf16 under a bf16 ``trainer.precision``, else fp32 (the encoders'
  weights while caching, and the caption encoder's for the sample prompts);
- under FSDP2 without ``block_classes``: the family's repeated blocks (transformer blocks; a U-Net's resnets too);
- ``export.filename: pipeline`` where it is the default (model.pt): the end of the run writes a diffusers folder;
- ``data.size_conditions: true`` for SDXL: each image's original size and crop go with its caption (``time_ids``);
- ``data.alignment`` raised to what the denoiser takes where it is not a multiple of it (SDXL: 64 pixels, a U-Net's
  three downsamplings of latents 8 times smaller; SD3, Flux, PixArt: 16, 2 x 2 patches).

A value the config sets otherwise is one line, exit 2; the values filled in are what a run's ``config.yaml`` holds,
so a resume from it finds them equal and goes on.
"""

import json
from dataclasses import dataclass

from lit_dist.errors import ConfigError

NET = "lit_dist.model.nets.pipeline.PipelineDenoiser"
VAE = "lit_dist.cache.encoders.VAEEncoder"
TEXT = "lit_dist.cache.encoders.PipelineTextEncoder"
FLOW = "lit_dist.model.objectives.FlowMatching"
DIFFUSION = "lit_dist.model.objectives.Diffusion"


@dataclass
class PipelineConfig:
    """A pretrained diffusers pipeline to fine-tune.

    Args:
        path: A diffusers pipeline folder (SD 1.5/2.x, SDXL, SD3, Flux, PixArt) or hub id (its snapshot in the Hugging
            Face cache, downloaded if missing); null: none (model.net is the model).
        gradient_checkpointing: Recompute the denoiser's activations in the backward pass: less memory, the time
            of a second forward pass.
        max_length: T5 tokens per caption (SD3, Flux, PixArt); null: the pipeline's own (256, 512, 300).
        guidance: Flux's embedded guidance while training a guidance-distilled model (Flux.1-dev); 1.0 as trained.
    """

    path: str | None = None
    gradient_checkpointing: bool = False
    max_length: int | None = None
    guidance: float = 1.0


def fill(config) -> list[str]:
    """Fill ``config`` (one command's jsonargparse Namespace) from ``config.pipeline``; returns the keys it set."""
    from jsonargparse import Namespace

    from lit_dist.cache.config import given_dir
    from lit_dist.cache.pipelines import read_folder

    settings = config.get("pipeline")
    if settings is None or not settings.path:
        return []
    folder = read_folder(settings.path, "pipeline.path")
    path = str(folder.path)
    model, data = config.model.init_args, config.data.init_args
    cache = data.get("cache")
    if cache is None or given_dir(cache.get("dir")) is None:
        raise ConfigError(f"pipeline.path = {settings.path!r} trains on the pipeline's own latents and caption "
                          "encodings, which are cached: set data.cache.dir (a local path or s3://bucket/prefix)")
    if tuple(data.get("mean") or ()) != (0.5,) * 3 or tuple(data.get("std") or ()) != (0.5,) * 3:
        raise ConfigError(f"data.mean = {list(data.mean)}, data.std = {list(data.std)}: a pipeline's VAE takes images "
                          "in [-1, 1]; remove both (their defaults, 0.5, are that)")

    net = Namespace(class_path=NET, init_args=Namespace(pipeline=path, gradient_checkpointing=settings.gradient_checkpointing,
                                                        guidance=settings.guidance))
    _same("model.net", model.get("net"), net, "pipeline.path names the denoiser: remove model.net")
    model.net = net
    model.objective = _objective(folder, model.get("objective"))
    key = cache.get("encoder_key") or "latent"
    if model.get("input_key") not in ("image", key):
        raise ConfigError(f"model.input_key = {model.input_key!r}: with pipeline.path the model reads the cached "
                          f"latents, {key!r}; remove model.input_key")
    model.input_key = key
    # The cache's encoders are plain dicts ({class_path, init_args}), built by the cache itself, not by the parser.
    vae = {"class_path": VAE, "init_args": {"pretrained": path, "subfolder": "vae"}}
    _same("data.cache.encoder", cache.get("encoder"), vae, "pipeline.path names the VAE: remove data.cache.encoder")
    text = {"class_path": TEXT, "init_args": {"pipeline": path, "max_length": settings.max_length}}
    _same("data.cache.caption_encoder", cache.get("caption_encoder"), text,
          "pipeline.path names the text encoders: remove data.cache.caption_encoder")
    cache.encoder, cache.caption_encoder, cache.pixels = vae, text, False
    filled = ["model.net", "model.objective", "model.input_key", "data.cache.encoder", "data.cache.caption_encoder",
              "data.cache.pixels"]
    if cache.get("compute_dtype", "auto") == "auto":
        # The frozen encoders in the precision the run computes in (a T5-XXL in bf16: 9.5 GB instead of 19).
        cache.compute_dtype = "bf16" if str(config.trainer.get("precision") or "").startswith("bf16") else "fp32"
        filled.append(f"data.cache.compute_dtype {cache.compute_dtype}")
    need = _alignment(folder)
    if int(data.get("alignment") or 8) % need:
        # Latents the denoiser cannot take (odd patches, a U-Net's downsamplings) would fail at the first step.
        data.alignment = need * -(-int(data.get("alignment") or 8) // need)
        filled.append(f"data.alignment {data.alignment} (a multiple of {need} pixels)")
    if folder.family.name == "sdxl" and not data.get("size_conditions"):
        data.size_conditions = True  # each image's original size and crop, as SDXL was trained with
        filled.append("data.size_conditions")
    export = config.get("export")
    if export is not None and export.get("filename") == "model.pt":  # the default: a file no pipeline loads
        export.filename = "pipeline"
        filled.append("export.filename pipeline (a diffusers folder)")
    strategy = config.trainer.get("strategy")
    if getattr(strategy, "class_path", "").endswith(".FSDP2Strategy") and not strategy.init_args.get("block_classes"):
        # The family's transformer (and resnet) blocks, and the denoiser itself: its pipeline calls it directly when
        # drawing samples, past PipelineDenoiser's forward, so its own parameters must be a unit of their own.
        library, class_name = folder.index[folder.family.denoiser]
        strategy.init_args.block_classes = [*folder.family.blocks, f"{library}.{class_name}"]
        filled.append("trainer.strategy.init_args.block_classes")
    return filled


def _alignment(folder) -> int:
    """Pixels per step of a bucket side that the family's denoiser takes: the VAE's factor times the denoiser's
    (a transformer's patch, Flux's 2 x 2 packing, a U-Net's downsamplings)."""
    def config(name: str) -> dict:
        return json.loads((folder.path / name / "config.json").read_text())

    vae = 2 ** (len(config("vae").get("block_out_channels", [0])) - 1)
    denoiser = config(folder.family.denoiser)
    if folder.family.denoiser == "unet":
        return vae * 2 ** (len(denoiser.get("block_out_channels", [0])) - 1)
    return vae * int(denoiser.get("patch_size") or 2)


def _plain(value):
    """A Namespace (or a dict) as plain dicts, for comparing what a config holds with what is filled in."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return json.loads(json.dumps(value, default=str)) if value is not None else None


def _same(field: str, given, filled, fix: str) -> None:
    """Nothing, when ``given`` is unset or what is filled in (a saved config.yaml); else one ConfigError."""
    if given is None:
        return
    ours, theirs = _plain(filled), _plain(given)
    theirs_args = {k: v for k, v in (theirs.get("init_args") or {}).items() if v is not None}
    ours_args = {k: v for k, v in (ours.get("init_args") or {}).items() if v is not None}
    if theirs.get("class_path") != ours["class_path"]:
        raise ConfigError(f"{field} is set to {theirs.get('class_path')} and pipeline.path fills it: {fix}")
    for k, v in ours_args.items():
        if theirs_args.get(k) != v:  # e.g. a saved config.yaml whose hub id's snapshot has changed since
            raise ConfigError(f"{field}.init_args.{k} = {theirs_args.get(k)!r} and pipeline.path fills in {v!r}: "
                              f"{fix}")


def _objective(folder, given):
    """The family's objective with the schedule of the folder's scheduler/, keeping what ``given`` sets otherwise."""
    from jsonargparse import Namespace

    where = folder.path / "scheduler" / "scheduler_config.json"
    try:
        scheduler = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"pipeline.path: {where} cannot be read ({exc}); the folder is incomplete: download it "
                          "again") from exc
    wanted = FLOW if folder.family.flow else DIFFUSION
    if given is not None and given.get("class_path") not in (wanted, None):
        kind = "flow matching" if folder.family.flow else "a DDPM noise schedule (diffusion)"
        raise ConfigError(f"model.objective is {given.class_path}, and {folder.path} is a {folder.family.name} "
                          f"pipeline, trained with {kind}: use {wanted} or remove model.objective")
    args = Namespace(**(_plain(given.get("init_args")) if given is not None and given.get("init_args") else {}))
    if folder.family.flow:
        dynamic = bool(scheduler.get("use_dynamic_shifting", False))
        args.dynamic_shift = dynamic
        args.shift = 1.0 if dynamic else float(scheduler.get("shift", 1.0))
        for name in ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len"):
            if name in scheduler:
                setattr(args, name, scheduler[name])
    else:
        if scheduler.get("trained_betas") is not None:
            raise ConfigError(f"pipeline.path: {where} lists its own betas (trained_betas); lit-dist trains with a "
                              "named beta_schedule: set trained_betas to null and the beta_schedule it came from")
        args.prediction = scheduler.get("prediction_type", "epsilon")
        args.beta_schedule = scheduler.get("beta_schedule", "linear")
        args.beta_start = float(scheduler.get("beta_start", 0.0001))
        args.beta_end = float(scheduler.get("beta_end", 0.02))
        args.num_train_timesteps = int(scheduler.get("num_train_timesteps", 1000))
        args.rescale_betas_zero_snr = bool(scheduler.get("rescale_betas_zero_snr", False))
    args.condition = "caption"
    return Namespace(class_path=wanted, init_args=args)
