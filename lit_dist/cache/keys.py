"""What identifies a cached entry, so that anything else is a miss and never a stale hit.

Each entry carries two 64-bit numbers:

- ``sample``: the sample itself, a hash of its dataset root and filename. An entry whose
  sample matches but whose key does not is *stale* (reported, rebuilt, never served).
- ``key``: everything that produced the entry: the source file's identity (size and
  modification time, or the object's ETag), the bucket it was resized for, and the
  field's *fingerprint*: the transform rule and, for encoders, the class path, init
  arguments, a sha256 of the weights and the stored dtype.

Both are computed with numpy over whole columns (``names.name_hashes``), a few
nanoseconds per sample, so a run checks millions of entries at every start.
"""

import hashlib
import json

import numpy as np

from lit_dist.reading import masks, tags
from lit_dist.reading.hashing import GOLDEN_GAMMA, MIX1, MIX2
from lit_dist.reading.names import name_hashes
from lit_dist.reading.presence import mtime
from lit_dist.runtime import outage

_M = np.uint64(GOLDEN_GAMMA)
PIXEL_RULE = {
    # How a pixel entry is made (lit_dist.reading.decode.covering); any change there must change the fingerprint.
    "version": 1,
    "decode": "Pillow, JPEG draft at the bucket size, EXIF transposed, RGB",
    "resize": "bilinear, reducing_gap 3.0, to cover the bucket (the smallest scale at which both sides cover it)",
    "stored": "uint8 (H, W, 3), the whole covering image: the crop happens at load",
}


def fingerprint(description: dict) -> str:
    """A stable hex id of a field's configuration (sha256 of its canonical JSON)."""
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _finalize(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place: every input bit affects every output bit."""
    h ^= h >> np.uint64(30)
    h *= np.uint64(MIX1)
    h ^= h >> np.uint64(27)
    h *= np.uint64(MIX2)
    h ^= h >> np.uint64(31)
    return h


def _combine(h: np.ndarray, value) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h ^ (np.asarray(value).astype(np.uint64) + _M + (h << np.uint64(6)) + (h >> np.uint64(2)))
    return _finalize(h)


def _scalar(text: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little"))


def sample_ids(filenames, root: str) -> np.ndarray:
    """The ``sample`` of each filename (a pyarrow string array) under ``root``: uint64."""
    return _combine(name_hashes(filenames), _scalar(root.rstrip("/")))


def entry_keys(samples: np.ndarray, identity: np.ndarray, bucket_sizes: np.ndarray, field_fingerprint: str) -> np.ndarray:
    """The ``key`` of each sample: its id, its source file's identity, its bucket (width, height) and the field."""
    h = _combine(samples, identity)
    h = _combine(h, bucket_sizes[:, 0].astype(np.uint64) << np.uint64(32) | bucket_sizes[:, 1].astype(np.uint64))
    return _combine(h, _scalar(field_fingerprint))


def caption_order(samples: np.ndarray, caption_hashes: np.ndarray, order: int,
                  keep_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The sample ids and sources (``entry_keys``' identity) of captions' entries in tag order ``order``
    (``reading/tags.py``; ``caption_hashes``: the texts' name_hashes). Order 0's are the caption's own, so a cache
    built before orders existed serves it; another order is a sample of its own, whose source is the caption with
    the order, keep_tokens and the shuffle's ``tags.RULE`` (never the shuffled text: no pass over the captions)."""
    if order == 0:
        return samples, caption_hashes
    return _combine(samples, order), _combine(_combine(_combine(caption_hashes, order), keep_tokens), tags.RULE)


def mask_sources(identity: np.ndarray, source, root: str, storage_options: dict | None = None) -> np.ndarray:
    """``entry_keys``' identity of each row's mask entry (``source``: its dataset's ``reading.masks.Masks``, None
    without masks): an alpha mask's is its image's (``identity``) with a tag; a mask file's is the file's own, from
    one listing of ``root`` as ``listed_identity``, with its name (another column, another key); a dataset without
    masks has one for all its rows (their entries: all 255)."""
    if source is None:
        return np.full(len(identity), masks.NONE, np.uint64)
    if source.alpha:
        return _combine(identity, masks.ALPHA)
    names = source.files.fill_null("")
    return _combine(listed_identity(root, names, storage_options), name_hashes(names))


def identity_hash(sizes: np.ndarray | None, mtimes: np.ndarray | None = None, etags=None) -> np.ndarray:
    """One uint64 per source file from its size and modification time (seconds, float; to the microsecond) or its
    ETag."""
    if etags is not None:
        h = name_hashes(etags)
        return h if sizes is None else _combine(h, sizes)
    h = _finalize(np.asarray(sizes).astype(np.uint64).copy())
    if mtimes is not None:
        # Microseconds, rounded. mtimes arrive as float64 seconds (os.stat's st_mtime through fsspec, the table's
        # mtime column), which carry about 0.24 us at today's epoch (53-bit mantissa): a microsecond is the finest
        # step the float records, so a file rewritten within the same second is a new key; rounding, not
        # truncating, keeps a float one ulp off the same key (a float->int cast of ns would key on that noise).
        h = _combine(h, np.round(np.asarray(mtimes, dtype=np.float64) * 1e6).astype(np.int64).view(np.uint64))
    return h


def listed_identity(root: str, filenames, storage_options: dict | None = None) -> np.ndarray:
    """Each file's version from a listing of ``root``, for tables without bytes and mtime columns.

    One listing (``find``) of the whole root, not a request per file; a file that is not there
    gets identity 0, and fails to decode when its entry is built.
    """
    import pyarrow as pa

    fs, base = outage.url_to_fs(root, **(storage_options or {}))
    base = base.rstrip("/")
    listing = {name[len(base) + 1 :]: info for name, info in fs.find(base, detail=True).items()}
    names = filenames.to_pylist() if hasattr(filenames, "to_pylist") else list(filenames)
    infos = [listing.get(n, {}) for n in names]
    sizes = np.array([int(i.get("size") or 0) for i in infos], dtype=np.int64)
    etags = [i.get("ETag") or i.get("etag") for i in infos]
    if any(etags):
        return identity_hash(sizes, etags=pa.array([e or "" for e in etags], pa.string()))

    return identity_hash(sizes, np.array([mtime(i) if i else 0.0 for i in infos], dtype=np.float64))
