"""The denoiser of a pretrained diffusers pipeline, called as every lit-dist denoiser is.

``PipelineDenoiser(pipeline=FOLDER)`` loads the folder's ``unet/`` or ``transformer/`` with its own class and
config, and takes ``net(x_t, timestep, condition)`` like ``TinyUNet``: ``x_t`` the noisy latents (B, C, h, w),
``timestep`` (B,) on diffusers' 0-to-1000 scale, ``condition`` the caption cache's fields for the family
(``CONDITION``). Each family's glue below is what its diffusers pipeline does around the same call (checked
against the pipeline itself in tests/unit/test_pipeline_denoiser.py), so weights trained here load back into it.

    model:
      net:
        class_path: lit_dist.model.nets.pipeline.PipelineDenoiser
        init_args: {pipeline: /models/stable-diffusion-xl-base-1.0}
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from lit_dist.cache.pipelines import plain_name, read_folder, weights_variant
from lit_dist.errors import ConfigError
from lit_dist.runtime.extras import quiet_loading, require

# The condition each family's denoiser takes, by key: the caption cache's fields. SDXL also takes each sample's size
# and crop conditioning, ``time_ids`` (original height and width, crop top and left, target height and width), which
# the data module puts beside the caption (data.size_conditions); without them (samples) it gets what its pipeline
# gives by default: the image's own size, uncropped.
CONDITION = {
    "sd15": ("hidden",),
    "sdxl": ("hidden", "pooled"),
    "sd3": ("hidden", "pooled"),
    "flux": ("hidden", "pooled"),
    "pixart": ("hidden", "mask"),
}


class PipelineDenoiser(nn.Module):
    """The trained part of a diffusers pipeline folder: ``net(x_t, timestep, condition) -> x_t``'s shape."""

    def __init__(self, pipeline: str, gradient_checkpointing: bool = False, guidance: float = 1.0):
        """Load it.

        Args:
            pipeline: A diffusers pipeline folder (SD 1.5/2.x, SDXL, SD3, Flux, PixArt): its unet/ or transformer/.
            gradient_checkpointing: Recompute activations in the backward pass: less memory, the time of a second
                forward pass.
            guidance: Flux's embedded guidance while training a guidance-distilled model (Flux.1-dev); 1.0 as trained.
        """
        super().__init__()
        require("diffusers", "model.net PipelineDenoiser")
        self.folder = read_folder(pipeline)
        self.family = self.folder.family.name
        # from_pretrained leaves a model in eval mode; the trainer's modes are per module (Lightning keeps them).
        self.model = self.folder.load(self.folder.family.denoiser, "model.net.init_args.pipeline").train()
        # Pixels per latent along a side, as the pipelines compute it: PixArt-alpha's size conditions are in pixels.
        vae = json.loads((self.folder.path / "vae" / "config.json").read_text())
        self.vae_scale = 2 ** (len(vae["block_out_channels"]) - 1)
        if gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.guidance = guidance

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, condition: dict | torch.Tensor | None) -> torch.Tensor:
        c = self._condition(condition)
        if self.family in ("sd15", "sdxl"):
            extra = {"added_cond_kwargs": {"text_embeds": c["pooled"], "time_ids": self._time_ids(x, c)}} \
                if self.family == "sdxl" else {}
            return self.model(x, timestep, encoder_hidden_states=c["hidden"], **extra, return_dict=False)[0]
        if self.family == "sd3":
            return self.model(hidden_states=x, timestep=timestep, encoder_hidden_states=c["hidden"],
                              pooled_projections=c["pooled"], return_dict=False)[0]
        if self.family == "flux":
            return self._flux(x, timestep, c)
        out = self.model(x, encoder_hidden_states=c["hidden"], encoder_attention_mask=c["mask"], timestep=timestep,
                         added_cond_kwargs=self._pixart_sizes(x), return_dict=False)[0]
        # A model that learned its variance as well (PixArt's out_channels = 2 x in) gives the noise in its first half.
        return out[:, : x.shape[1]] if out.shape[1] == 2 * x.shape[1] else out

    def _condition(self, condition) -> dict:
        """The family's condition fields, or one ConfigError naming what is missing."""
        needed = CONDITION[self.family]
        if isinstance(condition, torch.Tensor) and needed == ("hidden",):
            return {"hidden": condition}
        if not isinstance(condition, dict) or not set(needed) <= condition.keys():
            given = sorted(condition) if isinstance(condition, dict) else type(condition).__name__
            raise ConfigError(f"model.net: the {self.family} denoiser takes a condition with {', '.join(needed)}, "
                              f"and got {given}: cache the captions with the pipeline's own text encoders")
        return condition

    @torch.no_grad()
    def draw(self, condition: dict, empty: dict | None, noise: torch.Tensor, steps: int, guidance: float,
             seed: int = 0) -> torch.Tensor:
        """Latents (B, C, h, w) drawn by the family's own diffusers pipeline class (its scheduler from the folder's
        scheduler/, its guidance) with this denoiser's weights, from the starting ``noise`` (B, C, h, w) and the
        caption fields ``condition``; ``empty`` (the empty caption, (1, ...) per field) is its negative prompt.
        The caller decodes them (its VAEDecoder). Flux takes ``guidance`` as its embedded guidance (Flux.1-dev), the
        others as classifier-free guidance."""
        pipeline = self._pipeline()
        b, _, h, w = noise.shape
        c = self._condition(condition)
        none = empty or {k: torch.zeros_like(v[:1]) for k, v in c.items()}
        e = {k: v.expand(b, *v.shape[1:]) for k, v in none.items()}
        call = {"height": h * self.vae_scale, "width": w * self.vae_scale, "num_inference_steps": steps,
                "guidance_scale": guidance, "output_type": "latent", "prompt_embeds": c["hidden"],
                "generator": torch.Generator(noise.device).manual_seed(seed)}
        if self.family == "flux":
            call["latents"] = type(pipeline)._pack_latents(noise, b, noise.shape[1], h, w)
        else:
            call["latents"] = noise
            call["negative_prompt_embeds"] = e["hidden"]
        if self.family in ("sdxl", "sd3", "flux"):
            call["pooled_prompt_embeds"] = c["pooled"]
        if self.family in ("sdxl", "sd3"):
            call["negative_pooled_prompt_embeds"] = e["pooled"]
        if self.family == "pixart":
            call.update(prompt_attention_mask=c["mask"], negative_prompt_attention_mask=e["mask"], negative_prompt=None,
                        use_resolution_binning=False)
        training = self.model.training
        try:
            latents = pipeline(**call).images
        finally:
            self.model.train(training)
        if self.family == "flux":
            latents = type(pipeline)._unpack_latents(latents, h * self.vae_scale, w * self.vae_scale, self.vae_scale)
        return latents

    def _pipeline(self):
        """The family's pipeline over this denoiser, made once: its scheduler from the folder, no text encoders (the
        captions come encoded) and a VAE of the folder's config without weights (latents out: the pipeline reads
        only its config). Kept outside the module's attributes: it holds no parameters of its own."""
        if self.model not in _DRAWERS:
            from diffusers import AutoencoderKL

            index = self.folder.index
            parts = {name: None for name in index if name.startswith(("text_encoder", "tokenizer"))}
            with _no_weights():
                vae = AutoencoderKL.from_config(AutoencoderKL.load_config(self.folder.path, subfolder="vae"))
            parts.update({self.folder.family.denoiser: self.model, "vae": vae})
            with quiet_loading():
                pipeline = self.folder.pipeline_class().from_pretrained(self.folder.path, **parts)
            pipeline.set_progress_bar_config(disable=True)
            _DRAWERS[self.model] = pipeline
        return _DRAWERS[self.model]

    def _time_ids(self, x: torch.Tensor, c: dict) -> torch.Tensor:
        """SDXL's (B, 6) size conditions: the batch's own, else (h, w, 0, 0, h, w) of the image the latents make."""
        if "time_ids" in c:
            return c["time_ids"]
        h, w = x.shape[-2] * self.vae_scale, x.shape[-1] * self.vae_scale
        return torch.tensor([[h, w, 0, 0, h, w]], device=x.device, dtype=x.dtype).repeat(x.shape[0], 1)

    def _flux(self, x: torch.Tensor, timestep: torch.Tensor, c: dict) -> torch.Tensor:
        """Flux's transformer takes 2 x 2 patches of the latents as tokens, their positions as ids, the timestep on a
        0-to-1 scale and, when guidance-distilled, the guidance (FluxPipeline's own preparation of each)."""
        b, ch, h, w = x.shape
        if h % 2 or w % 2:
            raise ConfigError(f"model.net: Flux takes latents of even height and width, and got {h} x {w}: use "
                              "buckets whose sides are multiples of 16 pixels")
        tokens = x.view(b, ch, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), ch * 4)
        image_ids = torch.zeros(h // 2, w // 2, 3, device=x.device, dtype=x.dtype)
        image_ids[..., 1] += torch.arange(h // 2, device=x.device, dtype=x.dtype)[:, None]
        image_ids[..., 2] += torch.arange(w // 2, device=x.device, dtype=x.dtype)[None, :]
        text_ids = torch.zeros(c["hidden"].shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if self.model.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=torch.float32)
        out = self.model(hidden_states=tokens, timestep=timestep / 1000, guidance=guidance,
                         pooled_projections=c["pooled"], encoder_hidden_states=c["hidden"], txt_ids=text_ids,
                         img_ids=image_ids.reshape(-1, 3), return_dict=False)[0]
        return out.view(b, h // 2, w // 2, ch, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, ch, h, w)

    def _pixart_sizes(self, x: torch.Tensor) -> dict:
        """PixArt-alpha at 1024 px conditions on the image's size and aspect ratio; the other models take none."""
        if not getattr(self.model, "use_additional_conditions", False):
            return {"resolution": None, "aspect_ratio": None}
        h, w = x.shape[-2] * self.vae_scale, x.shape[-1] * self.vae_scale
        b = x.shape[0]
        return {"resolution": torch.tensor([[h, w]], device=x.device, dtype=x.dtype).repeat(b, 1),
                "aspect_ratio": torch.tensor([[h / w]], device=x.device, dtype=x.dtype).repeat(b, 1)}


def write_pipeline(base: str, weights: dict, output: str, replace: bool = False) -> Path:
    """A diffusers pipeline folder at ``output`` that ``DiffusionPipeline.from_pretrained`` loads: the components of
    the pipeline folder ``base`` (hard-linked, or copied across filesystems), its denoiser's subfolder written anew
    with ``weights`` (a ``PipelineDenoiser``'s state dict) as safetensors, which
    ``<Denoiser>.from_pretrained(output, subfolder=...)`` loads alone. Written beside ``output`` and renamed into
    place: a folder that is there is whole. With ``replace``, a folder at ``output`` is replaced (once the new one
    is whole), else refused."""
    folder = read_folder(base, "--pipeline")
    name = folder.family.denoiser
    state = {k.removeprefix("model."): v for k, v in weights.items()}
    with whole_folder(output, replace) as partial:
        # File by file (shutil.copytree gathers its errors into one without an errno: a full disk would be no
        # longer told as one).
        variants = {}  # a component whose weights are one variant's only (--variant fp16): out under the plain names
        for source in sorted(folder.path.rglob("*")):
            relative = source.relative_to(folder.path)
            if relative.parts[0] == name or not source.is_file():
                continue
            if len(relative.parts) > 1 and relative.parts[0] not in variants:
                variants[relative.parts[0]] = weights_variant(folder.path / relative.parts[0], "--pipeline")
            variant = variants.get(relative.parts[0]) if len(relative.parts) > 1 else None
            destination = partial / relative.parent / (plain_name(source.name, variant) if variant else source.name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            if variant and source.name.endswith(".json") and destination.name != source.name:  # a sharded model's index
                index = json.loads(source.read_text())
                index["weight_map"] = {k: plain_name(v, variant) for k, v in index.get("weight_map", {}).items()}
                destination.write_text(json.dumps(index, indent=2))
            else:
                _link_or_copy(source, destination)
        model = empty_denoiser(folder)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ConfigError(f"the checkpoint's network does not fit {folder.path / name}: {len(missing)} weights "
                              f"missing ({', '.join(missing[:3])}), {len(unexpected)} unexpected "
                              f"({', '.join(unexpected[:3])}): was the run trained from another pipeline?")
        model.save_pretrained(partial / name, safe_serialization=True)
    return Path(output).expanduser().absolute()


@contextmanager
def whole_folder(output: str, replace: bool):
    """A folder written at ``output`` whole or not at all: yields a folder beside it to write into, renamed into
    place when the block ends without an error (removed if it raises). With ``replace``, a folder at ``output``
    is replaced once the new one is whole, else refused (ConfigError)."""
    import shutil
    import socket
    import uuid

    target = Path(output).expanduser().absolute()
    if target.exists() and not replace:
        raise ConfigError(f"--output {str(output)!r} exists: remove it, or name a new folder")
    _remove_leftovers(target)
    # Named by host and process: a later export removes what one killed mid-way left (_remove_leftovers).
    mark = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    partial = target.with_name(f".{target.name}.partial-{mark}")
    partial.mkdir(parents=True)
    try:
        yield partial
        if target.exists():  # replace: the old folder out of the way first (a folder is not renamed over another)
            old = target.with_name(f".{target.name}.old-{mark}")
            os.replace(target, old)
            os.replace(partial, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, target)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


def _remove_leftovers(target: Path) -> None:
    """The half-written folders (``.NAME.partial-HOST-PID-*``, ``.NAME.old-HOST-PID-*``) that an export of ``target``
    killed mid-way left beside it: those of this host whose process is gone."""
    import shutil
    import socket

    from lit_dist.runtime.processes import alive

    host = socket.gethostname()
    for kind in ("partial", "old"):
        for path in target.parent.glob(f".{target.name}.{kind}-{host}-*"):
            pid = path.name.removeprefix(f".{target.name}.{kind}-{host}-").split("-")[0]
            if pid.isdigit() and not alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the two folders share a filesystem (GBs of frozen encoders take no room and no time: neither
    diffusers nor lit-dist writes into a weight file in place), else a copy."""
    import shutil

    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def empty_denoiser(folder):
    """The folder's denoiser class built from its config with no weights (meta tensors) when accelerate is there."""
    import importlib

    library, class_name = folder.index[folder.family.denoiser]
    model_class = getattr(importlib.import_module(library), class_name)
    config = model_class.load_config(folder.path, subfolder=folder.family.denoiser)
    with _no_weights():
        return model_class.from_config(config)


def _no_weights():
    """Models built inside hold meta tensors (accelerate's init_empty_weights), or random ones without accelerate."""
    from contextlib import nullcontext

    try:
        from accelerate import init_empty_weights
    except ImportError:
        return nullcontext()
    return init_empty_weights()


# Each denoiser's sampling pipeline, by its model (held by the pipeline too: it lives as long as the process).
_DRAWERS: dict = {}
