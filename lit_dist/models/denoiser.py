"""A small conditional U-Net denoiser for the generative objectives (lit_dist.objectives), called as
``net(x_t, timestep, condition)``: small enough to train on a CPU in minutes, the shape of the real ones
(a timestep embedding and a condition modulating every block, cross-attention to caption tokens at the
lowest resolution). On a cluster name diffusers' ``UNet2DConditionModel`` or a transformer instead."""

import math

import torch
from torch import nn
from torch.nn import functional as F


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


class TinyUNet(nn.Module):
    """A conditional U-Net: ``net(x_t, timestep, condition) -> x_t``'s shape."""

    def __init__(self, in_channels: int = 3, channels: tuple[int, ...] = (32, 64, 128), context_dim: int | None = None,
                 num_classes: int | None = None, embed_dim: int = 128):
        """Build it.

        Args:
            in_channels: Channels of the noisy input: 3 for pixels, the VAE's latent channels for latents.
            channels: Channels of each resolution level (each level after the first halves the resolution).
            context_dim: Width of the caption embeddings (B, L, context_dim) or (B, context_dim); null: no captions.
            num_classes: With class labels as the condition: their number (label num_classes means "no label").
            embed_dim: Width of the timestep and condition embedding.
        """
        super().__init__()
        self.embed_dim = embed_dim
        self.time = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.SiLU(), nn.Linear(embed_dim, embed_dim))
        self.labels = nn.Embedding(num_classes + 1, embed_dim) if num_classes else None
        self.pooled = nn.Linear(context_dim, embed_dim) if context_dim else None
        self.stem = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        cin = channels[0]
        for cout in channels:
            self.down.append(Block(cin, cout, embed_dim))
            cin = cout
        self.attn = CrossAttention(cin, context_dim) if context_dim else None
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
            emb = emb + self.pooled(context.mean(1).to(x.dtype))
        h = self.stem(x)
        skips = []
        for i, block in enumerate(self.down):
            if i:
                h = F.avg_pool2d(h, 2)
            h = block(h, emb)
            skips.append(h)
        if self.attn is not None and context is not None:
            h = self.attn(h, context.to(h.dtype))
        h = self.mid(h, emb)
        for block in self.up:
            skip = skips.pop()
            if h.shape[-2:] != skip.shape[-2:]:
                h = F.interpolate(h, size=skip.shape[-2:], mode="nearest")
            h = block(torch.cat([h, skip], dim=1), emb)
        return self.out(h)
