"""Images from a denoiser trained by a generative objective (lit_dist.model.objectives), with diffusers' samplers:
flow-match Euler for ``FlowMatching``, DDIM on the training schedule for ``Diffusion``; classifier-free
guidance against the objective's own "no condition" (an all-zero caption embedding, or ``null_label``).
Each image's starting noise comes from its own seed (``initial_noise``), so that the same seeds give the
same images after a resume, at any world size and however images are batched, and training's random state
is never touched. Grids of the images go to PNG files (``write_grid``) and TensorBoard (``grid``)."""

import io
import os

import numpy as np
import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.model import conditions
from lit_dist.model.conditions import Condition
from lit_dist.model.objectives import Diffusion, FlowMatching, Generative, denoise, seeded_normal
from lit_dist.runtime.extras import require


def null_condition(objective: Generative, condition: Condition, empty: dict | None = None) -> Condition:
    """What the objective trained as "no condition", shaped like ``condition``: ``null_label``, the empty caption
    ``empty`` (a pipeline's caption fields, (1, ...) each), or all zeros."""
    if condition is None:
        return None
    if objective.condition == "label":
        if objective.null_label is None:
            raise ConfigError("guidance with labels needs model.objective.null_label (and a model trained with "
                              "condition_dropout > 0)")
        return torch.full_like(condition, objective.null_label)
    every = torch.ones(conditions.size(condition), dtype=torch.bool, device=conditions.device(condition))
    return conditions.replace(condition, every, empty)


def scheduler_for(objective: Generative, steps: int, shape: tuple[int, ...] | None = None):
    """A diffusers scheduler set to ``steps`` steps, matching how ``objective`` trained (a flow-matching shift by the
    token count needs the samples' ``shape``, (..., H, W))."""
    if steps < 1:
        raise ConfigError(f"sampling steps = {steps}: must be at least 1")
    require("diffusers", f"sampling from model.objective {type(objective).__name__} (diffusers' samplers)")
    if isinstance(objective, FlowMatching):
        from diffusers import FlowMatchEulerDiscreteScheduler

        if objective.dynamic_shift:
            # As FluxPipeline: its own sigmas from 1 to 1/steps, shifted by the mu of the image's token count.
            scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=1000, use_dynamic_shifting=True, base_shift=objective.base_shift,
                max_shift=objective.max_shift, base_image_seq_len=objective.base_image_seq_len,
                max_image_seq_len=objective.max_image_seq_len)
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(),
                                    mu=objective.mu(shape[-2], shape[-1]))
            return scheduler
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=objective.shift)
    elif isinstance(objective, Diffusion):
        from diffusers import DDIMScheduler

        scheduler = DDIMScheduler.from_config(objective.scheduler.config, clip_sample=False, set_alpha_to_one=True,
                                              timestep_spacing="trailing")
    else:
        raise ConfigError(f"{type(objective).__name__} is not a generative objective: nothing to sample")
    scheduler.set_timesteps(steps)
    return scheduler


def initial_noise(shape: tuple[int, ...], seed: int, indices) -> torch.Tensor:
    """(len(indices), *shape) standard normal noise, image ``i`` drawn on the CPU from its own seed (``seed``, ``i``):
    the same on any device and whichever other images share its batch."""
    return torch.stack([seeded_normal(tuple(shape), seed, i) for i in indices])


@torch.no_grad()
def sample(net: nn.Module, objective: Generative, condition: Condition, noise: torch.Tensor,
           steps: int = 30, guidance: float = 1.0, empty: dict | None = None) -> torch.Tensor:
    """Images (B, C, H, W) in the space the model trained in (pixels as normalised, or latents), from the
    starting ``noise`` of that shape (``initial_noise``). ``guidance`` > 1 mixes conditional and unconditional
    predictions (``empty``: the empty caption of a pipeline's encoders, see ``null_condition``)."""
    parameter = next(net.parameters())
    device, dtype = parameter.device, parameter.dtype
    shape = tuple(noise.shape)
    if hasattr(net, "draw") and isinstance(condition, dict):  # a pipeline's denoiser: its own pipeline class draws
        return net.draw(conditions.to(condition, device, dtype), conditions.to(empty, device, dtype),
                        noise.to(device=device, dtype=dtype), steps, guidance)
    scheduler = scheduler_for(objective, steps, shape)
    x = noise.to(device=device, dtype=dtype)
    if isinstance(objective, Diffusion):
        x = x * scheduler.init_noise_sigma
    condition = conditions.to(condition, device, dtype)
    guided = guidance != 1.0 and condition is not None
    null = null_condition(objective, condition, conditions.to(empty, device, dtype)) if guided else None
    for t in scheduler.timesteps:
        timestep = t.to(device=device, dtype=torch.float32).expand(shape[0])
        if guided:
            both = denoise(net, torch.cat([x, x]), torch.cat([timestep, timestep]), conditions.cat(condition, null))
            cond_out, null_out = both.chunk(2)
            out = null_out + guidance * (cond_out - null_out)
        else:
            out = denoise(net, x, timestep, condition)
        x = scheduler.step(out, t, x).prev_sample
    return x


def precision_plugin(precision, strategy, device: torch.device):
    """Lightning's precision plugin of a run's ``trainer.precision`` on ``device``, for drawing samples outside the
    Trainer as the run did: ``convert_module`` (half weights for -true) and ``forward_context`` (autocast for
    -mixed). Under DeepSpeed a 16-bit precision keeps the weights themselves in 16 bits (its engine casts them), so
    it is drawn as the -true precision of the same type."""
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

    from lit_dist.strategies.checks import strategy_name

    text = str(precision or "32-true")
    if "deepspeed" in strategy_name(strategy).lower() and text in ("bf16-mixed", "16-mixed"):
        text = text.replace("mixed", "true")
    if text in ("bf16-mixed", "16-mixed"):
        return MixedPrecision(text, device.type)
    if text in ("bf16-true", "16-true"):
        return HalfPrecision(text)
    if text in ("64-true", "64"):
        return DoublePrecision()
    return Precision()


def grid(pixels: torch.Tensor, rows: int, cols: int) -> np.ndarray:
    """``pixels`` (rows x cols, 3, H, W) uint8 as one (rows x H, cols x W, 3) image, row by row."""
    _, _, h, w = pixels.shape
    return np.ascontiguousarray(pixels.view(rows, cols, 3, h, w).permute(0, 3, 1, 4, 2).reshape(rows * h, cols * w, 3)
                                .numpy())


def write_grid(pixels: torch.Tensor, rows: int, cols: int, path: str, prompts: list[str] | None = None) -> None:
    """``pixels`` (rows x cols, 3, H, W) as one PNG, written whole or not at all (local or S3); with ``prompts``, the
    prompt of each row beside it, one per line (``step-N.txt`` next to ``step-N.png``: a model card names them)."""
    from PIL import Image

    from lit_dist.ckpt.files import filesystem, is_local, write_atomically

    png = io.BytesIO()
    Image.fromarray(grid(pixels, rows, cols)).save(png, format="PNG")
    fs, fs_path = filesystem(path if "://" in path else os.path.abspath(path))
    if is_local(fs):  # an object store has no folders to make
        os.makedirs(os.path.dirname(fs_path), exist_ok=True)
    write_atomically(fs, fs_path, lambda f: f.write(png.getvalue()))
    if prompts is not None:
        text = "".join(" ".join(str(p).split()) + "\n" for p in prompts).encode()
        write_atomically(fs, fs_path.removesuffix(".png") + ".txt", lambda f: f.write(text))


def encode_prompts(objective: Generative, data, prompts: list[str], field: str = "--prompt") -> tuple[list[str], Condition, dict | None]:
    """(prompts as shown, their condition on the CPU, the empty caption or None) for ``objective``: captions through
    the run's caption encoder (``data.cache.caption_encoder``), as its training captions were, with the empty caption
    of an encoder that returns several fields (lit_dist.cache.captions.empty_caption, as its cache holds it); labels
    as class numbers or the data's class names; nothing for an unconditioned model."""
    if objective.condition == "none":
        return list(prompts), None, None
    if objective.condition == "label":
        classes = list(getattr(data, "classes", None) or [])
        labels = [_label(p, classes, field) for p in prompts]
        shown = [classes[i] if 0 <= i < len(classes) else str(i) for i in labels]
        return shown, torch.tensor(labels, dtype=torch.int64), None
    spec = getattr(getattr(data, "cache", None), "caption_encoder", None)
    if spec is None:
        raise ConfigError(f"data.cache.caption_encoder is not set: {field} is encoded by the run's caption encoder, "
                          "as its captions were")
    from lit_dist.cache.captions import empty_caption
    from lit_dist.cache.encoders import load_encoder

    # In the dtype the cache's captions were encoded in (a data module's own cache object may not say: fp32).
    encoder = load_encoder(spec, "caption_encoder", getattr(data.cache, "compute", "fp32"))
    with torch.no_grad():
        condition = encoder(list(prompts))  # (P, ...), or a dict of them
        if not isinstance(condition, dict):
            return list(prompts), condition.float(), None
        return list(prompts), _floats(condition), _floats(empty_caption(encoder))


def _floats(fields: dict) -> dict:
    """A pipeline's caption fields as the cache gives them to the model: float32 on the CPU."""
    return {key: value.float().cpu() for key, value in fields.items()}


def _label(prompt: str, classes: list[str], field: str) -> int:
    text = prompt.strip()
    if text.isdigit():
        return int(text)
    if text in classes:
        return classes.index(text)
    known = f"the names {classes}" if classes else "numbers (the data's class names are not known here)"
    raise ConfigError(f"{field} has {text!r}: a label-conditioned model takes class numbers or {known}")


def decoder_of(objective: Generative, data):
    """The frozen decoder that turns the model's samples into images: None for pixels, the VAE decoder matching
    ``data.cache.encoder`` for latents (ConfigError where there is none)."""
    if objective.input_key == "image":
        return None
    spec = getattr(getattr(data, "cache", None), "encoder", None)
    if spec is None:
        raise ConfigError(f"model.input_key = {objective.input_key!r}: its samples are decoded by the VAE that made the "
                          "cache (data.cache.encoder), and none is set")
    from lit_dist.cache.encoders import decoder_for

    return decoder_for(spec)


def shape_of(decoder, size: int, field: str) -> tuple[int, int, int]:
    """One sample's shape (C, H, W) for square images of ``size`` pixels a side."""
    if decoder is None:
        return (3, size, size)
    channels, factor = decoder.latent_shape_factor
    if size % factor:
        raise ConfigError(f"{field} = {size}: the VAE makes one latent per {factor} pixels; use a multiple of {factor}")
    return (channels, size // factor, size // factor)


@torch.no_grad()
def decode(images: torch.Tensor, decoder, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Samples (pixels as normalised, or latents with their ``decoder``) as uint8 pixels (N, 3, H, W) on the CPU,
    with the data's (1, 3, 1, 1) ``mean`` and ``std`` on the 0-255 scale (BucketDataModule's)."""
    if decoder is not None:
        images = decoder(images.to(next(decoder.parameters()).dtype))
    return (images.float().cpu() * std + mean).clamp(0, 255).round().to(torch.uint8)
