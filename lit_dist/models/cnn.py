"""A small convolutional classifier that takes images of any size and aspect ratio."""

import torch
from torch import nn


class SimpleCNN(nn.Module):
    """Conv-BN-ReLU stages with stride 2, then global average pooling and a linear head.

    Global pooling is what makes it size-agnostic: every aspect-ratio bucket of a
    run goes through the same weights.
    """

    def __init__(self, num_classes: int = 10, channels: tuple[int, ...] = (16, 32, 64), in_channels: int = 3):
        """Build the network.

        Args:
            num_classes: Number of output classes (logits).
            channels: Output channels of each stride-2 stage; the length is the depth.
            in_channels: Channels of the input images (3 for RGB).
        """
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_channels
        for width in channels:
            layers += [nn.Conv2d(prev, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            prev = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # (B, C, H / 2**depth, W / 2**depth)
        x = x.mean(dim=(2, 3))  # (B, C)
        return self.head(x)  # (B, num_classes)
