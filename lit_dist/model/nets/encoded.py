"""``EncodedNet``: a frozen encoder, then a trainable network, in one module.

What training on an encoder cache replaces: the encoder runs on every step. It is the baseline the
latent workflow is measured against (same encoder, same network), and the way to train on encoder
outputs without a cache (e.g. with augmentations the cache would freeze).
"""

import torch
from torch import nn


class EncodedNet(nn.Module):
    """``net(encoder(x))`` with ``encoder`` frozen (eval mode, no gradients)."""

    def __init__(self, encoder: nn.Module, net: nn.Module):
        """Compose the two.

        Args:
            encoder: The frozen encoder, e.g. lit_dist.cache.encoders.VAEEncoder.
            net: The network trained on the encoder's outputs.
        """
        super().__init__()
        self.encoder = encoder.eval().requires_grad_(False)
        self.net = net

    def train(self, mode: bool = True) -> "EncodedNet":
        super().train(mode)
        self.encoder.eval()  # frozen: its norm layers and dropout stay in inference mode
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = self.encoder(x)  # (B, C, h, w)
        return self.net(z)
