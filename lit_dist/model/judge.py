"""Prompt adherence: whether a generated image shows what its prompt asked for (``samples.judge``).

A judge is called with the images as uint8 pixels (N, 3, H, W) on the CPU and their prompts (N strings),
and returns (N,) booleans; ``samples/adherence`` is their mean. Any subclass of ``Judge`` named by
``class_path`` works (the shapes demo's: ``lit_dist.data.demo.judge.ShapesJudge``).
"""

import torch


class Judge:
    """Says, per image, whether it shows what its prompt asked for."""

    def __call__(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """(N,) bool for ``pixels`` (N, 3, H, W) uint8 and their ``prompts``."""
        raise NotImplementedError

    def check(self, prompts: list[str]) -> None:
        """ConfigError for prompts this judge cannot read (called on every rank before any image is made)."""
