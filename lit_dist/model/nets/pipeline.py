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

import torch
from torch import nn

from lit_dist.cache.pipelines import read_folder
from lit_dist.errors import ConfigError
from lit_dist.runtime.extras import require

# The condition each family's denoiser takes, by key: the caption cache's fields. SDXL also takes each sample's size
# and crop conditioning, ``time_ids`` (original height and width, crop top and left, target height and width); without
# them it gets what its pipeline gives by default: the image's own size, uncropped.
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
            gradient_checkpointing: Recompute activations in the backward pass: less memory, about a third more time.
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
            raise ConfigError(f"model.net: the {self.family} denoiser takes a condition with {', '.join(needed)}, and got "
                              f"{given}: cache the captions with the pipeline's own text encoders")
        return condition

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
