"""Asynchronous saves: copy the state aside in a fraction of a second (the write runs on a thread).

Training goes on while the copy is written, so the copy must not share memory with tensors the
next optimizer step changes. The buffers are kept from one save to the next: copying into memory
that is already mapped runs several times faster than into freshly allocated memory (page faults),
and the next save waits for the previous write anyway, so they are free again by then.
"""

import torch
from lightning_utilities.core.apply_func import apply_to_collection


class Snapshot:
    """Copies every tensor of a checkpoint into CPU buffers reused across saves (pinned for GPU tensors)."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []

    def take(self, checkpoint: dict) -> dict:
        """The checkpoint with each tensor replaced by a CPU copy; tensors shared in it stay shared."""
        copies: dict[int, torch.Tensor] = {}
        on_gpu = False

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal on_gpu
            if id(tensor) in copies:  # tied weights are one tensor: copy and save them once
                return copies[id(tensor)]
            if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):  # sparse, DTensor...
                copied = tensor.detach().to("cpu", copy=True)
            else:
                copied = self._buffer(len(copies), tensor)
                copied.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                on_gpu |= tensor.is_cuda
            copies[id(tensor)] = copied
            return copied

        state = apply_to_collection(checkpoint, torch.Tensor, copy)
        if on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies must land before another thread reads them
        return state

    def _buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0))
        buffer = self._buffers[index]
        if buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
            self._buffers[index] = buffer
        return buffer

