"""Where an image that covers its bucket is cropped to the bucket's size: at a random position while training
(from the seed, the epoch and the sample alone, so a resumed or re-sharded run crops the same), at the centre for
evaluation and for a cache's encoder inputs (one fixed crop per image)."""

import numpy as np

from lit_dist.reading.hashing import sample_word


def crop_offsets(seed: int, epoch: int, index: int, free_x: int, free_y: int) -> tuple[int, int]:
    """The random crop's (left, top), in 0..free_x and 0..free_y, from (seed, epoch, index) alone: the two
    32-bit halves of ``sample_word``. Taking 32 bits modulo at most a few thousand positions, the offsets' bias is
    below 1e-6."""
    word = sample_word(seed, epoch, index)
    return (word & 0xFFFFFFFF) % (free_x + 1), (word >> 32) % (free_y + 1)


def covering_size(image_width: int, image_height: int, width: int, height: int) -> tuple[int, int]:
    """(W', H'): the size an image of ``image_width`` x ``image_height`` is resized to so that it covers (width,
    height) whole, keeping its aspect ratio; the crop to the bucket is taken from it."""
    scale = max(width / image_width, height / image_height)
    return max(width, round(image_width * scale)), max(height, round(image_height * scale))


def centre_offsets(covering_width: int, covering_height: int, width: int, height: int) -> tuple[int, int]:
    """The evaluation crop's (left, top) in a covering image: its centre."""
    return (covering_width - width) // 2, (covering_height - height) // 2


def centre_crop(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """The evaluation crop: the centre (width, height) of a covering image."""
    left, top = centre_offsets(image.shape[1], image.shape[0], width, height)
    return image[top : top + height, left : left + width]
