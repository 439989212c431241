"""Decoding an image file's bytes to cover its bucket: the one rule a training batch and a pixel cache share
(``lit_dist.cache.keys.PIXEL_RULE`` describes it in every pixel entry's fingerprint: change one, change both).

Only bytes that do not decode are a bad image here (``BadImage``); reading them, and telling a missing file
from an outage of the store, is the caller's (``BucketImageDataset.covering``).
"""

import io
import re

import numpy as np

from lit_dist.reading.crops import covering_size
from lit_dist.reading.unreadable import BadImage, decode_errors


def covering(data: bytes, width: int, height: int) -> np.ndarray:
    """``data`` decoded and resized to cover (width, height) whole, uncropped: (H', W', 3) uint8.

    This is what a pixel cache stores: the crop is left to load time, so it varies as it does without one.
    """
    return _covering(data, width, height, alpha=False)[0]


def covering_with_alpha(data: bytes, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """``covering`` and the image's alpha channel resized alike, (H', W') uint8: 255 everywhere for an image without
    one. The colours are exactly ``covering``'s (decoded without the alpha: Pillow's resize of RGBA premultiplies)."""
    return _covering(data, width, height, alpha=True)


def covering_mask(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """A mask image's bytes as (H', W') uint8 (its luminance) at ``size`` (W', H'): its image's covering size. A mask
    of another aspect ratio than its image is a bad sample (stretched it would mark the wrong pixels)."""
    from PIL import Image, ImageOps

    try:
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("L")
    except decode_errors() as exc:
        raise BadImage(f"its mask: {reason(exc)}") from exc
    # The covering size rounds each side to a pixel: a small image's aspect ratio moves by up to 1 / its short side.
    aspect = size[0] / size[1]
    if abs(img.width / img.height - aspect) > aspect * (0.02 + 1 / min(size)):
        raise BadImage(f"its mask is {img.width}x{img.height}, of another aspect ratio than the image")
    if img.size != size:
        img = img.resize(size, Image.BILINEAR, reducing_gap=3.0)
    return np.asarray(img)


def _covering(data: bytes, width: int, height: int, alpha: bool) -> tuple[np.ndarray, np.ndarray | None]:
    from PIL import Image, ImageOps

    try:
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (width, height))  # JPEG: decode at a reduced scale when that still covers the bucket
        img = ImageOps.exif_transpose(img)
        opacity = None
        if alpha and (img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info):
            opacity = img.convert("RGBA").getchannel("A")
        img = img.convert("RGB")
    except decode_errors() as exc:
        raise BadImage(reason(exc)) from exc
    resized = covering_size(img.width, img.height, width, height)
    if resized != img.size:
        img = img.resize(resized, Image.BILINEAR, reducing_gap=3.0)
        if opacity is not None:
            opacity = opacity.resize(resized, Image.BILINEAR, reducing_gap=3.0)
    if not alpha:
        return np.asarray(img), None  # (H', W', C)
    return np.asarray(img), (np.asarray(opacity) if opacity is not None
                             else np.full((resized[1], resized[0]), 255, np.uint8))


def reason(exc: Exception) -> str:
    """Why a file could not be read, without the address of the file object Pillow names (the path is shown)."""
    return re.sub(r"\s*<[^<>]* object at 0x[0-9a-fA-F]+>", "", str(exc)) or type(exc).__name__


def guard_against_bombs(max_pixels: int | None) -> None:
    """Pillow's decompression-bomb limit for this process, set once rather than per image.

    Pillow raises above 2x the limit and only warns between 1x and 2x; the warning is made
    an error too, so such an image is replaced like any unreadable one.
    """
    import warnings

    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_pixels
    warnings.simplefilter("error", Image.DecompressionBombWarning)
