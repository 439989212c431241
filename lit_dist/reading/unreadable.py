"""What counts as a bad sample, and what does not.

A sample is *bad* when its file is missing, its bytes do not decode as an image, it is a
decompression bomb, or its cache entry is missing or damaged: it is replaced by another sample of
its bucket and counted (``lit_dist/data/health.py``). Anything else is not the sample's fault and propagates:
a bug in lit-dist, a permission or credentials error (a ``DataError`` naming the file), an object
store or disk that does not answer (an outage is never a bad sample, and never substituted).
"""

import functools

from lit_dist.errors import DataError

# The file is not there (deleted since the table or listing was made): a bad sample, not an outage.
MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError)


class BadSample(Exception):
    """A sample that cannot be used: replaced by another sample of its bucket and counted."""


class BadImage(BadSample):
    """An image file that is missing or whose bytes do not decode."""


@functools.cache
def decode_errors() -> tuple[type[BaseException], ...]:
    """What Pillow raises for damaged image bytes: the list Pillow's own fuzz tests accept
    (Tests/test_fuzzers.py). Caught only around decoding bytes already read, so an I/O error of the
    storage never lands here."""
    from PIL import Image

    return (OSError, SyntaxError, MemoryError, ValueError, NotImplementedError, OverflowError,
            Image.DecompressionBombError, Image.DecompressionBombWarning)


def permission_denied(path: str, exc: BaseException) -> DataError:
    """The data error for a file this process may not read: a user's fix, not a bad sample."""
    return DataError(f"cannot read {path}: permission denied ({exc}). Give this user read access to the dataset; "
                     "on an object store check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                     "AWS_PROFILE) and the bucket's policy.")


class UnreadableInARow(DataError):
    """Every sample tried in a row of one bucket was bad: the data, not one file, is broken. Raised in a loader
    worker, it reaches the user as its own message too (``LitDistError`` unwraps PyTorch's re-raise)."""
