"""Samples that are byte ranges of larger files: the images of a Hugging Face dataset's Arrow files and of tar
shards (an index row's ``offset`` and ``length``). One read per sample: ``os.pread`` on a descriptor kept open per file on a local disk,
one ranged GET on an object store; a range past the file's end (a truncated file) is a bad sample. The samples of a
batch that lie near each other in one file (``data.shuffle_block`` puts them there) are read with one request.
"""

import os

from lit_dist.ckpt.files import is_local
from lit_dist.reading.unreadable import BadImage

_OPEN_LIMIT = 64  # descriptors kept open per process; the oldest is closed past it
# Bytes between two samples that one read spans rather than making two. A request to an object store costs
# milliseconds, which buy a megabyte of transfer; a local read only its system call, so less is skipped over there.
GAP_BYTES = {True: 256 << 10, False: 1 << 20}
RUN_BYTES = 64 << 20  # at most this much in one read


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

    def read_upto(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of ``path`` from ``offset``: fewer where the file ends before them."""
        if self.local:
            return os.pread(self._fd(path), length, offset)
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def runs(self, spans: list[tuple[int, int, int]]) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """``spans`` (offset, length, key) of one file grouped into what one read each fetches: (start, end, spans),
        neighbours joined where at most ``GAP_BYTES`` lie between them and the read stays within ``RUN_BYTES``."""
        gap, out = GAP_BYTES[self.local], []
        for span in sorted(spans):
            offset, length, _ = span
            if out and offset - out[-1][1] <= gap and offset + length - out[-1][0] <= RUN_BYTES:
                out[-1][1] = max(out[-1][1], offset + length)
                out[-1][2].append(span)
            else:
                out.append([offset, offset + length, [span]])
        return [(start, end, run) for start, end, run in out]

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= _OPEN_LIMIT:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def __getstate__(self) -> dict:  # a spawned worker opens its own
        return {**self.__dict__, "_fds": {}}
