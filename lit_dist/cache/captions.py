"""Caption encoders with several outputs in the cache: one vector per caption, its layout and the empty caption.

A pipeline's text encoders give a dict per batch of captions (``PipelineTextEncoder``: ``hidden``, ``pooled``,
``mask``). The cache stores one vector per caption, the fields flattened and joined in name order, in
``data.cache.encoder_dtype``; the ``Layout`` (each field's name and shape) turns a batch of vectors back into the
dict on the device. Beside the entries, once per fingerprint, ``caption_encoder/empty/<fingerprint>.npz`` holds the
empty caption as the family's pipeline encodes it (SDXL: zeros, as its ``force_zeros_for_empty_prompt``), rounded
through the stored dtype as every entry is: condition dropout and the sampler's guidance use it for "no caption",
so both match what the pipeline does with no negative prompt. The file's fields and shapes are the layout, so a run
that reads the cache (mode read) needs neither the encoder nor a forward pass to know it.

An encoder that returns a dict says what stands for "no caption" with a method ``empty_caption()`` (the same dict
for one caption). An encoder returning one tensor is stored as it is, with no layout and no empty caption (zeros
stand for it).
"""

import io
import math
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from lit_dist.errors import ConfigError, DataError

FOLDER = "empty"  # under the caption_encoder field's folder


def empty_key(caption_key: str) -> str:
    """The batch key of the empty caption (a dict of (1, ...) tensors) a data module sends beside the captions of
    ``caption_key``; the objective's condition dropout reads it."""
    return f"{caption_key}_empty"


@dataclass(frozen=True)
class Layout:
    """The fields of one caption's vector, in order: (name, shape per caption)."""

    fields: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, fields: dict) -> "Layout":
        """The layout of a dict of (B, ...) tensors or arrays: name order, shapes without the batch."""
        return cls(tuple((name, tuple(int(d) for d in fields[name].shape[1:])) for name in sorted(fields)))

    @property
    def width(self) -> int:
        return sum(math.prod(shape) for _, shape in self.fields)

    def flatten(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, width) float32: each field flattened, joined in name order (integer masks as 0.0 and 1.0)."""
        return torch.cat([fields[name].reshape(len(fields[name]), -1).float() for name, _ in self.fields], dim=1)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of a (B, width) batch of vectors, views of it."""
        out, start = {}, 0
        for name, shape in self.fields:
            n = math.prod(shape)
            out[name] = flat[:, start : start + n].view(len(flat), *shape)
            start += n
        return out

    def describe(self) -> str:
        return ", ".join(f"{name} {list(shape)}" for name, shape in self.fields)


@dataclass
class Captions:
    """What reading a multi-field caption cache needs: the layout and the empty caption, (1, ...) float32 per field."""

    layout: Layout
    empty: dict[str, torch.Tensor]


def empty_caption(encoder) -> dict[str, torch.Tensor] | None:
    """What a multi-field ``encoder`` gives for "no caption" (its ``empty_caption()``: the family's pipeline's rule);
    None for an encoder of one tensor per caption, for which zeros stand."""
    if not hasattr(encoder, "empty_caption"):
        return None
    with torch.inference_mode():
        return encoder.empty_caption()


def rounded(fields: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``fields`` as float32 after a round trip through the stored dtype (what reading an entry gives)."""
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    return {name: value.detach().cpu().float().to(target).float() for name, value in fields.items()}


def record(store, fingerprint: str, encoder, dtype: str) -> None:
    """Rank 0 at a build: write the empty caption of a multi-field encoder for ``fingerprint`` (once; ``encoder``:
    a function that gives the encoder, called only then)."""
    path = store.path("caption_encoder", FOLDER, f"{fingerprint}.npz")
    if store.fs.exists(path):
        return
    empty = empty_caption(encoder())
    if empty is None:
        return  # one tensor per caption: stored as it is, zeros stand for no caption
    wrong = not isinstance(empty, dict) or any(not isinstance(v, torch.Tensor) or len(v) != 1 for v in empty.values())
    if wrong:
        raise ConfigError(f"data.cache.caption_encoder's empty_caption() gave {type(empty).__name__}: it must give a "
                          "dict of (1, ...) tensors, the encoder's fields for one caption")
    buffer = io.BytesIO()
    np.savez(buffer, **{name: value.numpy() for name, value in rounded(empty, dtype).items()})
    from lit_dist.ckpt.files import write_bytes_atomically

    write_bytes_atomically(store.fs, path, buffer.getvalue())


def load(store, fingerprint: str) -> Captions | None:
    """The layout and empty caption recorded for ``fingerprint``; None for an encoder of one tensor per caption."""
    path = store.path("caption_encoder", FOLDER, f"{fingerprint}.npz")
    try:
        with store.fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            empty = {name: torch.from_numpy(arrays[name].astype(np.float32)) for name in arrays.files}
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as exc:  # truncated, or not an npz
        raise DataError(f"{store.url}/caption_encoder/{FOLDER}/{fingerprint}.npz is damaged ({exc}): delete it and "
                        "run `lit-dist cache --config <this config>`, which writes it again") from exc
    return Captions(Layout.of(empty), empty)
