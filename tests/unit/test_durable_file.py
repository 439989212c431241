"""DurableFile: checkpoint files written around the page cache (O_DIRECT), byte for byte what was written, on disk
when closed; buffered where a filesystem refuses O_DIRECT; a failure mid-write leaves no open file behind."""

import errno
import os
import random

import pytest
import torch

from lit_dist.ckpt import files
from lit_dist.ckpt.files import DurableFile, write_atomically
from lit_dist.ckpt.space import full_error
from tests.helpers.small_fs import mounter


def _direct_flag_set(fd: int) -> bool:
    """What the kernel says of the open file: its flags in /proc, in octal."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
    return bool(flags & os.O_DIRECT)


def _takes_o_direct(folder) -> bool:
    """Whether this folder's filesystem opens files with O_DIRECT (tmpfs only since Linux 6.6)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(os.path.join(folder, ".probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, ".probe"))
    return True


def _pieces(seed: int, total: int, buffer_bytes: int) -> list[bytes]:
    """``total`` random bytes cut at the places that matter: a block's edge, the buffer's, on both sides, and a
    piece larger than the buffer."""
    rng = random.Random(seed)
    sizes = [1, 4095, 4096, 4097, buffer_bytes - 1, buffer_bytes, buffer_bytes + 1, 3 * buffer_bytes + 7, 0]
    out, left = [], total
    while left > 0:
        n = min(left, rng.choice(sizes + [rng.randrange(1, 2 * buffer_bytes)]))
        out.append(rng.randbytes(n))
        left -= n
    return out


@pytest.fixture
def small_fs(tmp_path):
    yield from mounter(tmp_path / "mounts")


@pytest.mark.parametrize("total", [0, 1, 4096, 5000, 16 << 10, (16 << 10) + 1, 200_003])
@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_a_durable_file_holds_exactly_what_was_written(tmp_path, small_fs, where, total):
    folder = tmp_path if where == "disk" else small_fs("t", 4096)
    pieces = _pieces(total, total, buffer_bytes=16 << 10)
    path = str(folder / "f")
    with DurableFile(path, buffer_bytes=16 << 10) as f:
        assert _direct_flag_set(f.fileno()) == f.direct
        for piece in pieces:
            assert f.write(memoryview(piece)) == len(piece)
        assert f.size == total
    assert f.fd is None
    with open(path, "rb") as read:
        assert read.read() == b"".join(pieces)  # the tail's padding cut back: same size, same bytes
    assert f.direct == _takes_o_direct(folder)  # around the cache wherever the filesystem allows it


def test_a_file_read_again_soon_is_written_through_the_cache(tmp_path):
    data = random.Random(2).randbytes(70_000)
    with DurableFile(str(tmp_path / "f"), buffer_bytes=16 << 10, through_cache=True) as f:
        assert not f.direct and not _direct_flag_set(f.fileno())
        f.write(data)
    assert (tmp_path / "f").read_bytes() == data


def test_cache_shards_are_written_through_the_cache_and_checkpoints_around_it(tmp_path, monkeypatch):
    import pyarrow as pa

    from lit_dist.cache.store import CacheStore

    opened = []
    real_init = DurableFile.__init__

    def recording(self, path, *args, **kwargs):
        real_init(self, path, *args, **kwargs)
        opened.append((os.path.basename(path).split(".tmp-")[0], self.direct))

    monkeypatch.setattr(DurableFile, "__init__", recording)
    sink = pa.BufferOutputStream()
    index = pa.table({"key": pa.array([], pa.string())})
    with pa.ipc.new_file(sink, index.schema) as writer:
        writer.write_table(index)
    store = CacheStore(str(tmp_path / "cache"))
    store.write_shard("pixels", "f" * 8, b"shard bytes", sink.getvalue().to_pybytes(), raw_bytes=11, samples=1,
                      entries=1)
    write_atomically(*files.filesystem(str(tmp_path / "state.ckpt")), lambda f: f.write(b"weights"))
    shards = [direct for name, direct in opened if name.endswith(".arrow")]
    assert shards == [False, False], opened
    assert [direct for name, direct in opened if name == ".state.ckpt"] == [bool(getattr(os, "O_DIRECT", 0))], opened


def test_where_the_filesystem_refuses_o_direct_at_open_the_file_is_written_buffered(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")  # what open(2) says on a filesystem without O_DIRECT
        return real_open(path, flags, *args)

    monkeypatch.setattr(files.os, "open", refusing)
    data = random.Random(0).randbytes(100_000)
    with DurableFile(str(tmp_path / "f"), buffer_bytes=16 << 10) as f:
        assert not f.direct and not _direct_flag_set(f.fileno())
        f.write(data)
    assert (tmp_path / "f").read_bytes() == data


def test_where_a_direct_write_is_refused_the_file_goes_on_buffered(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem does not take O_DIRECT")
    real_write, refused = os.write, []

    def refusing_direct(fd, data):
        if _direct_flag_set(fd):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")  # a device whose blocks are larger than 4 KiB
        return real_write(fd, data)

    monkeypatch.setattr(files.os, "write", refusing_direct)
    data = random.Random(1).randbytes(50_001)
    with DurableFile(str(tmp_path / "f"), buffer_bytes=16 << 10) as f:
        assert f.direct
        f.write(data)
        assert not f.direct and not _direct_flag_set(f.fileno())
    assert refused == [16 << 10]
    assert (tmp_path / "f").read_bytes() == data


def test_a_write_that_raises_closes_the_file_unfinished(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with DurableFile(str(tmp_path / "f"), buffer_bytes=16 << 10) as f:
            f.write(b"x" * 40_000)
            raise KeyboardInterrupt
    assert f.fd is None
    assert (tmp_path / "f").stat().st_size == 32 << 10  # two full buffers reached the file; the rest did not


def test_a_full_disk_raises_no_space_and_leaves_no_file_open(small_fs):
    small = small_fs("small", 256)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as raised:
        write_atomically(*files.filesystem(str(small / "state.pt")), lambda f: f.write(os.urandom(1 << 20)))
    assert raised.value.errno == errno.ENOSPC, raised.value  # not a BufferError of a view left on the buffer
    # os.write names no file: the line of a full disk must say which one did not fit, by the name the user knows.
    assert raised.value.filename == str(small / "state.pt"), raised.value
    assert os.listdir(small) == []  # the temporary file is gone
    assert set(os.listdir("/proc/self/fd")) <= before
    with pytest.raises(Exception) as raised:  # a torch.save into it: torch's error may hold the OSError
        write_atomically(*files.filesystem(str(small / "model.pt")), lambda f: torch.save(torch.ones(1 << 18), f))
    assert full_error(raised.value).filename == str(small / "model.pt"), raised.value
    with pytest.raises(OSError) as raised, DurableFile(str(small / "shard")) as f:  # a sharded save's file
        f.write(os.urandom(1 << 20))
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(small / "shard"))
