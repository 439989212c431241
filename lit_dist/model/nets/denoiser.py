"""A small conditional U-Net denoiser for the generative objectives (lit_dist.model.objectives), called as
``net(x_t, timestep, condition)``: small enough to train on a CPU in minutes, the shape of the real ones
(a timestep embedding and a pooled condition modulating every block, cross-attention to caption tokens at
every resolution but the first). On a cluster name diffusers' ``UNet2DConditionModel`` or a transformer instead.

Caption tokens get a learned embedding of their position before anything attends to them. A pretrained text
encoder already says which word a colour belongs to; the small random one of the quickstart says little, and
without positions "a blue circle on a red background" and "a red circle on a blue background" are the same
set of tokens to an attention layer: trained so, the samples had their two colours swapped as often as not.
For the same reason the pooled condition is an attention pool (one learned query), not a mean."""

import math

import torch
from torch import nn
from torch.nn import functional as F

from lit_dist.errors import ConfigError


def timestep_embedding(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding (B, dim) of timesteps on diffusers' 0-to-1000 scale."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=timestep.device, dtype=torch.float32) / half)
    args = timestep.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class Block(nn.Module):
    """Two 3x3 convolutions with GroupNorm, the embedding as a scale and shift between them, a residual."""

    def __init__(self, cin: int, cout: int, emb: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(min(8, cin), cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.film = nn.Linear(emb, 2 * cout)
        self.norm2, self.conv2 = nn.GroupNorm(min(8, cout), cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.film(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.conv2(F.silu(self.norm2(h) * (1 + scale) + shift))
        return h + self.skip(x)


class CrossAttention(nn.Module):
    """Image positions attend to caption tokens (B, L, D)."""

    def __init__(self, channels: int, context_dim: int, heads: int = 4):
        super().__init__()
        self.norm = nn.GroupNorm(min(8, channels), channels)
        self.attn = nn.MultiheadAttention(channels, heads, kdim=context_dim, vdim=context_dim, batch_first=True)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q = self.norm(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        out, _ = self.attn(q, context, context, need_weights=False)
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class AttentionPool(nn.Module):
    """Caption tokens (B, L, D) to one vector (B, out): a learned query attends over the tokens (each head with its
    own projection of it)."""

    def __init__(self, context_dim: int, out: int, heads: int = 4):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, context_dim) * context_dim**-0.5)
        self.attn = nn.MultiheadAttention(context_dim, heads, batch_first=True)
        self.proj = nn.Linear(context_dim, out)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        pooled, _ = self.attn(self.query.expand(len(context), -1, -1), context, context, need_weights=False)
        return self.proj(pooled[:, 0])


class TinyUNet(nn.Module):
    """A conditional U-Net: ``net(x_t, timestep, condition) -> x_t``'s shape."""

    def __init__(self, in_channels: int = 3, channels: tuple[int, ...] = (32, 64, 128), context_dim: int | None = None,
                 num_classes: int | None = None, embed_dim: int = 128, max_tokens: int = 256):
        """Build it.

        Args:
            in_channels: Channels of the noisy input: 3 for pixels, the VAE's latent channels for latents.
            channels: Channels of each resolution level (each level after the first halves the resolution).
            context_dim: Width of the caption embeddings (B, L, context_dim) or (B, context_dim); null: no captions.
            num_classes: With class labels as the condition: their number (label num_classes means "no label").
            embed_dim: Width of the timestep and condition embedding.
            max_tokens: Most caption tokens (L) it takes: each position has a learned embedding.
        """
        super().__init__()
        self.embed_dim = embed_dim
        self.time = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.SiLU(), nn.Linear(embed_dim, embed_dim))
        self.labels = nn.Embedding(num_classes + 1, embed_dim) if num_classes else None
        # The caption normalised, then its positions at half its scale: at GPT-2's 0.02 they were too faint to be
        # learned from in a short run (a caption and its reverse still looked alike after 80 steps; at 0.3 to 1.0
        # their losses differed tenfold), and a pretrained encoder's outputs can have any scale.
        self.context_norm = nn.LayerNorm(context_dim) if context_dim else None
        self.positions = nn.Parameter(torch.randn(max_tokens, context_dim) * 0.5) if context_dim else None
        self.pooled = AttentionPool(context_dim, embed_dim) if context_dim else None
        self.stem = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down, self.attn = nn.ModuleList(), nn.ModuleList()
        cin = channels[0]
        for i, cout in enumerate(channels):
            self.down.append(Block(cin, cout, embed_dim))
            # At every level but the first (full resolution, where attention costs the most and adds the least).
            self.attn.append(CrossAttention(cout, context_dim) if context_dim and i else nn.Identity())
            cin = cout
        self.mid = Block(cin, cin, embed_dim)
        self.up = nn.ModuleList()
        for skip in reversed(channels):
            self.up.append(Block(cin + skip, skip, embed_dim))
            cin = skip
        self.out = nn.Sequential(nn.GroupNorm(min(8, cin), cin), nn.SiLU(), nn.Conv2d(cin, in_channels, 3, padding=1))
        nn.init.zeros_(self.out[-1].weight)
        nn.init.zeros_(self.out[-1].bias)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.time(timestep_embedding(timestep, self.embed_dim).to(x.dtype))
        context = None
        if condition is not None and self.labels is not None:
            emb = emb + self.labels(condition)
        elif condition is not None and self.pooled is not None:
            context = condition if condition.dim() == 3 else condition[:, None]  # (B, L, D)
            if context.shape[1] > len(self.positions):
                raise ConfigError(f"model.net: TinyUNet got {context.shape[1]} caption tokens, more than its "
                                  f"max_tokens ({len(self.positions)}): raise model.net.init_args.max_tokens")
            context = self.context_norm(context.to(x.dtype)) + self.positions[: context.shape[1]].to(x.dtype)
            emb = emb + self.pooled(context)
        h = self.stem(x)
        skips = []
        for i, (block, attn) in enumerate(zip(self.down, self.attn, strict=True)):
            if i:
                h = F.avg_pool2d(h, 2)
            h = block(h, emb)
            if context is not None and isinstance(attn, CrossAttention):
                h = attn(h, context)
            skips.append(h)
        h = self.mid(h, emb)
        for block in self.up:
            skip = skips.pop()
            if h.shape[-2:] != skip.shape[-2:]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = block(torch.cat([h, skip], dim=1), emb)
        return self.out(h)
