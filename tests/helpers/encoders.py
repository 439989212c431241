"""Frozen encoders for cache tests, named in YAML as ``tests.helpers.encoders.<Name>``."""

import torch
from torch import nn


class TinyEncoder(nn.Module):
    """A strided convolution with weights from ``seed``: (B, 3, H, W) -> (B, channels, H / scale, W / scale).

    ``bump`` adds to one weight: a changed encoder whose config looks otherwise the same.
    """

    def __init__(self, channels: int = 4, seed: int = 0, bump: float = 0.0, scale: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, kernel_size=scale, stride=scale)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g) * 0.1)
            self.conv.bias.zero_()
            self.conv.weight[0, 0, 0, 0] += bump

    def forward(self, x):
        return self.conv(x)


class FlatEncoder(nn.Module):
    """Flattens its input: the output's only dimension grows with the bucket, which no model can take."""

    def forward(self, x):
        return x[:, :1, ::8, ::8].flatten(1)


class PooledEncoder(nn.Module):
    """A fixed-size output whatever the bucket: (B, 3) channel means."""

    def forward(self, x):
        return x.mean(dim=(2, 3))


class ByteCaptionEncoder(nn.Module):
    """Captions -> (B, dim): the mean of a seeded embedding of each caption's bytes (``ordered``: each weighted by its
    position, so that the same words in another order encode differently). A caption holding ``unreadable`` raises
    OSError, as an encoder whose files went missing after the cache was built would."""

    def __init__(self, dim: int = 8, seed: int = 0, unreadable: str | None = None, ordered: bool = False):
        super().__init__()
        self.table = nn.Embedding(256, dim)
        self.unreadable, self.ordered = unreadable, ordered
        with torch.no_grad():
            self.table.weight.copy_(torch.randn(256, dim, generator=torch.Generator().manual_seed(seed)))

    def forward(self, texts: list[str]) -> torch.Tensor:
        if self.unreadable and any(self.unreadable in t for t in texts):
            raise OSError(f"[Errno 2] No such file or directory: 'tokenizer/{self.unreadable}.json'")
        out = []
        for text in texts:
            embedded = self.table(torch.tensor(list(text.encode()) or [0]))  # (bytes, dim)
            if self.ordered:
                embedded = embedded * torch.linspace(1.0, 2.0, len(embedded))[:, None]
            out.append(embedded.mean(0))
        return torch.stack(out)  # (B, dim)
