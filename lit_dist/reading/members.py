"""Samples that are byte ranges of larger files: the images of a Hugging Face dataset's Arrow files and of tar
shards (an index row's ``offset`` and ``length``). One read per sample: ``os.pread`` on a descriptor kept open per file on a local disk,
one ranged GET on an object store; a range past the file's end (a truncated file) is a bad sample.
"""

import os

from lit_dist.ckpt.files import is_local
from lit_dist.reading.unreadable import BadImage

_OPEN_LIMIT = 64  # descriptors kept open per process; the oldest is closed past it


class Members:
    """Reads byte ranges of the files of one dataset. ``pread`` moves no file offset, so a forked loader worker
    shares the descriptors it inherits safely."""

    def __init__(self, fs):
        self.fs, self.local = fs, is_local(fs)
        self._fds: dict[str, int] = {}

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from ``offset``; BadImage when the file ends before them."""
        if self.local:
            data = os.pread(self._fd(path), length, offset)
        else:
            data = self.fs.cat_file(path, start=offset, end=offset + length)
        if len(data) != length:
            raise BadImage(f"{path} ends before this sample's bytes ({offset} + {length}): the file is truncated")
        return data

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= _OPEN_LIMIT:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def __getstate__(self) -> dict:  # a spawned worker opens its own
        return {**self.__dict__, "_fds": {}}
