"""Loss masks: which pixels of a training image the loss counts (kohya's ``--masked_loss`` with ``--alpha_mask`` or
mask images; SimpleTuner's mask datasets).

A dataset's masks come from the images' own alpha channel or from mask images that a column of its table names
(``DatasetSource.alpha_mask``, ``mask_column``): white (opaque) counts, black (transparent) does not, grey counts
in part. A mask is decoded to the size its image covers its bucket at, and cropped where the image is cropped; a
cache of encoder outputs keeps it beside them on their grid (``to_grid``: each cell the mean of the pixels it
covers, of the centre crop the encoder saw). The objective weighs each pixel's error by it
(``lit_dist.model.objectives.loss_mask``).
"""

from dataclasses import dataclass

import numpy as np

# How a cached mask entry is made; any change here must change the fingerprint (cache/plan.py folds it in, with the
# encoder's description: the grid is the encoder's).
MASK_RULE = {
    "version": 1,
    "decode": "alpha: the image's alpha channel, 255 without one; a mask file: its luminance (Pillow L); "
              "bilinear, reducing_gap 3.0, to the image's covering size",
    "crop": "centre of the bucket-sized image, as the encoder's input",
    "grid": "mean of each encoder output cell's pixels (adaptive average pooling), rounded",
    "stored": "uint8 (h, w)",
}
ALPHA = 0x414C504841  # folded into an alpha mask's source identity: the image's, read for another field
NONE = 0x4E4F4E45  # the source identity of a dataset without masks in a run with some: all 255


@dataclass(frozen=True)
class Masks:
    """Where one dataset's loss masks come from."""

    files: object = None  # pyarrow strings by table position: each mask's path relative to the image root; null: none
    alpha: bool = False  # the images' alpha channels

    def name(self, position: int) -> str | None:
        """The mask file of table position ``position`` (None: no mask file, or masks from alpha)."""
        if self.files is None:
            return None
        return self.files[position].as_py() or None

    def take(self, positions: np.ndarray) -> "Masks":
        """This source for the rows ``positions`` alone (a split pickled for a spawned loader worker)."""
        if self.files is None:
            return self
        import pyarrow as pa

        return Masks(self.files.take(pa.array(positions)), self.alpha)


def to_grid(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """``mask`` (H, W) uint8 on a (height, width) grid: each cell the rounded mean of the pixels it covers."""
    if mask.shape == (height, width):
        return mask
    import torch
    from torch.nn import functional as F

    cells = F.adaptive_avg_pool2d(torch.tensor(mask, dtype=torch.float32)[None, None], (height, width))
    return cells[0, 0].round().clamp(0, 255).to(torch.uint8).numpy()


def full(height: int, width: int) -> np.ndarray:
    """The mask of an image without one: every pixel counts."""
    return np.full((height, width), 255, np.uint8)
