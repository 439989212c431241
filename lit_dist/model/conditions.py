"""What a denoiser is conditioned on, and what stands for "no condition".

A condition is a tensor whose first dimension is the batch (caption embeddings (B, ...), class labels (B,)), or a
dict of such tensors: a pretrained pipeline's caption fields (``hidden``, ``pooled``, ``mask``) and SDXL's
``time_ids``. The functions here treat both alike, so that the objectives, the sampler and the samples need not
care which they hold.

"No caption" is the empty caption as the family's pipeline encodes it (``empty``: a dict of (1, ...) tensors, the
caption fields only; SDXL's size conditions are never dropped) or, without one, all zeros (as SDXL's
``force_zeros_for_empty_prompt``).
"""

import torch

Condition = torch.Tensor | dict[str, torch.Tensor] | None


def size(condition: Condition) -> int:
    """The batch size of a condition (0 for None)."""
    if condition is None:
        return 0
    if isinstance(condition, dict):
        return len(next(iter(condition.values())))
    return len(condition)


def device(condition: torch.Tensor | dict[str, torch.Tensor]) -> torch.device:
    """The device a condition is on."""
    return next(iter(condition.values())).device if isinstance(condition, dict) else condition.device


def take(condition: Condition, index: torch.Tensor) -> Condition:
    """The rows ``index`` (B,) of a condition."""
    if condition is None:
        return None
    if isinstance(condition, dict):
        return {key: value[index.to(value.device)] for key, value in condition.items()}
    return condition[index.to(condition.device)]


def cat(first: Condition, second: Condition) -> Condition:
    """Two conditions of the same kind, one after the other along the batch."""
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: torch.cat([value, second[key]]) for key, value in first.items()}
    return torch.cat([first, second])


def to(condition: Condition, device: torch.device, dtype: torch.dtype) -> Condition:
    """On ``device``, its floating-point tensors in ``dtype`` (labels and masks of integers stay integers). Without
    autocast (bf16-true, DeepSpeed's bf16) a denoiser that does not cast its condition itself (diffusers'
    UNet2DConditionModel) fails on float32 embeddings against bf16 weights."""
    if condition is None:
        return None
    if isinstance(condition, dict):
        return {key: to(value, device, dtype) for key, value in condition.items()}
    return condition.to(device=device, dtype=dtype if condition.is_floating_point() else condition.dtype)


def replace(condition: Condition, drop: torch.Tensor, empty: dict[str, torch.Tensor] | None) -> Condition:
    """``condition`` with the rows where ``drop`` (B,) bool is true replaced by "no caption": ``empty``'s fields
    (broadcast from (1, ...)), the other fields kept; all zeros where there is no ``empty``."""
    if isinstance(condition, dict):
        fields = empty.keys() if empty is not None else condition.keys()
        out = dict(condition)
        for key in fields:
            value = condition[key]
            none = empty[key].to(value) if empty is not None else torch.zeros_like(value)
            out[key] = torch.where(drop.view(-1, *[1] * (value.dim() - 1)), none, value)
        return out
    return torch.where(drop.view(-1, *[1] * (condition.dim() - 1)), torch.zeros_like(condition), condition)
