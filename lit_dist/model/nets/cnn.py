"""A small convolutional classifier that takes images of any size and aspect ratio."""

from typing import Literal

import torch
from torch import nn


class ConvStage(nn.Sequential):
    """Conv 3x3 stride 2, a norm layer, ReLU: one block (the unit FSDP shards)."""

    def __init__(self, in_channels: int, out_channels: int, norm: str = "batch"):
        layer = nn.BatchNorm2d(out_channels) if norm == "batch" else nn.GroupNorm(min(8, out_channels), out_channels)
        super().__init__(nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False), layer, nn.ReLU(inplace=True))


class SimpleCNN(nn.Module):
    """Conv-BN-ReLU stages with stride 2, then global average pooling and a linear head.

    Global pooling is what makes it size-agnostic: every aspect-ratio bucket of a
    run goes through the same weights.
    """

    def __init__(self, num_classes: int = 10, channels: tuple[int, ...] = (16, 32, 64), in_channels: int = 3,
                 norm: Literal["batch", "group"] = "batch"):
        """Build the network.

        Args:
            num_classes: Number of output classes (logits).
            channels: Output channels of each stride-2 stage; the length is the depth.
            in_channels: Channels of the input images (3 for RGB).
            norm: batch (BatchNorm, statistics per device) or group (GroupNorm, per sample: independent of
                how a batch is split over devices).
        """
        super().__init__()
        stages: list[nn.Module] = []
        prev = in_channels
        for width in channels:
            stages.append(ConvStage(prev, width, norm))
            prev = width
        self.features = nn.Sequential(*stages)
        self.head = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # (B, C, H / 2**depth, W / 2**depth)
        x = x.mean(dim=(2, 3))  # (B, C)
        return self.head(x)  # (B, num_classes)
