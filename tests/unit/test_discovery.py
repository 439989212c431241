import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow.parquet as pq
import pytest
from PIL import Image

from lit_dist.data.discovery import load_or_scan, merge_shares, scan_folder
from lit_dist.runtime.distributed import Comm
from tests.conftest import lit_dist


def make_images(root):
    (root / "cats").mkdir(parents=True)
    (root / "dogs" / "big").mkdir(parents=True)
    Image.new("RGB", (40, 20)).save(root / "cats" / "a.png")
    Image.new("RGB", (30, 60)).save(root / "dogs" / "big" / "b.jpg")
    rotated = Image.new("RGB", (50, 10))
    exif = rotated.getexif()
    exif[0x0112] = 6  # rotate 90: displayed as 10 x 50
    rotated.save(root / "dogs" / "c.jpg", exif=exif)
    (root / "dogs" / "broken.jpg").write_bytes(b"not a jpeg")
    (root / "notes.txt").write_text("not an image")


def test_scan_reads_sizes_from_headers_with_exif_rotation_and_folder_labels(tmp_path):
    make_images(tmp_path / "imgs")
    table = scan_folder(str(tmp_path / "imgs"), labels_from_folders=True, progress=False).to_pydict()
    rows = {f: (w, h, label) for f, w, h, label in zip(table["filename"], table["width"], table["height"], table["label"], strict=True)}
    assert rows == {"cats/a.png": (40, 20, "cats"), "dogs/big/b.jpg": (30, 60, "dogs"),
                    "dogs/c.jpg": (10, 50, "dogs"), "dogs/broken.jpg": (0, 0, "dogs")}


def test_the_cache_is_reused_for_unchanged_files_and_preserved_on_request(tmp_path):
    root = tmp_path / "imgs"
    make_images(root)
    cache = str(tmp_path / "cache" / "index.parquet")
    load_or_scan(str(root), cache, progress=False)
    # Same byte size and mtime: the row is reused. The bytes are now garbage, so a re-read would give 0 x 0.
    path = root / "cats" / "a.png"
    stat = path.stat()
    path.write_bytes(b"\0" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    load_or_scan(str(root), cache, progress=False)
    assert pq.read_table(cache).to_pydict()["width"][0] == 40
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # now changed: read again
    load_or_scan(str(root), cache, progress=False)
    assert pq.read_table(cache).to_pydict()["width"][0] == 0
    Image.new("RGB", (8, 8)).save(root / "cats" / "new.png")
    load_or_scan(str(root), cache, preserve_cache=True, progress=False)
    assert "cats/new.png" not in pq.read_table(cache).column("filename").to_pylist()
    load_or_scan(str(root), cache, progress=False)
    assert "cats/new.png" in pq.read_table(cache).column("filename").to_pylist()


@pytest.mark.process
def test_index_command_writes_a_table_training_can_read(tmp_path):
    make_images(tmp_path / "imgs")
    out = lit_dist("index", str(tmp_path / "imgs"), "--output", str(tmp_path / "meta.parquet"), "--labels_from_folders", "true")
    assert out.returncode == 0, out.stderr
    assert "4 images" in out.stdout and "1 unreadable" in out.stdout
    from lit_dist.data.metadata import read_metadata

    meta = read_metadata(str(tmp_path / "meta.parquet"))
    assert len(meta) == 3 and meta.bad.counts == {"missing or non-positive width/height": 1}


class ThreadComm(Comm):
    """``world`` ranks as threads of one process: Comm's collectives over a threading barrier, so the scan's
    real protocol (who lists, who reads what, who writes) runs without a process group."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier):
        super().__init__(rank, world)
        self.slots, self._barrier = slots, barrier

    def all_gather(self, obj) -> list:
        self.slots[self.rank] = obj
        self._barrier.wait()
        gathered = list(self.slots)
        self._barrier.wait()  # no rank overwrites its slot before every rank has read them all
        return gathered

    def broadcast(self, obj):
        return self.all_gather(obj)[0]


def on_ranks(world: int, function) -> list:
    """``function(comm)`` on ``world`` ranks at once; their results in rank order."""
    slots, barrier = [None] * world, threading.Barrier(world, timeout=60)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(function, ThreadComm(rank, world, slots, barrier)) for rank in range(world)]
        return [f.result() for f in futures]


def make_many_images(root, count: int = 23) -> None:
    make_images(root)
    for i in range(count):  # uneven folders, so strided shares cut across them
        folder = root / ("cats" if i % 3 else "birds")
        folder.mkdir(exist_ok=True)
        Image.new("RGB", (10 + i, 40 - i)).save(folder / f"{i:03d}.{'png' if i % 2 else 'jpg'}")


def test_merged_shares_come_back_in_their_original_order():
    items = list(range(11))
    assert merge_shares([items[r::3] for r in range(3)]) == items
    assert merge_shares([items]) == items and merge_shares([[], []]) == []


def test_a_scan_split_over_ranks_gives_the_one_process_table_and_reads_each_header_once(tmp_path, monkeypatch):
    import lit_dist.data.discovery as discovery

    root = tmp_path / "imgs"
    make_many_images(root)
    alone = scan_folder(str(root), labels_from_folders=True, progress=False)
    read_by = {}
    real_read = discovery._read_sizes

    def recording_read(fs, paths, *args):
        read_by[threading.current_thread().name] = list(paths)
        return real_read(fs, paths, *args)

    monkeypatch.setattr(discovery, "_read_sizes", recording_read)
    tables = on_ranks(3, lambda comm: scan_folder(str(root), labels_from_folders=True, progress=False, comm=comm))
    assert tables[0].equals(alone) and tables[1] is None and tables[2] is None
    shares = list(read_by.values())
    assert len(shares) == 3 and all(shares)
    assert sorted(p for share in shares for p in share) == sorted(str(root / f) for f in alone.column("filename").to_pylist())


def test_a_split_load_or_scan_reuses_unchanged_rows_and_every_rank_finds_the_cache(tmp_path):
    root = tmp_path / "imgs"
    make_many_images(root)
    cache = str(tmp_path / "cache" / "index.parquet")
    load_or_scan(str(root), cache, progress=False)
    first = pq.read_table(cache)
    path = root / "cats" / "a.png"  # same byte size and mtime, garbage bytes: reused, not re-read
    stat = path.stat()
    path.write_bytes(b"\0" * stat.st_size)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    Image.new("RGB", (8, 9)).save(root / "cats" / "new.png")

    def on_rank(comm):
        load_or_scan(str(root), cache, progress=False, comm=comm)
        return pq.read_table(cache)  # right after the collective: every rank can read it

    tables = on_ranks(2, on_rank)
    rows = dict(zip(tables[0].column("filename").to_pylist(), tables[0].column("width").to_pylist(), strict=True))
    assert rows["cats/a.png"] == 40 and rows["cats/new.png"] == 8 and len(rows) == first.num_rows + 1
    assert tables[1].equals(tables[0])
    assert tables[0].equals(scan_folder(str(root), previous=first, progress=False))


def test_a_rank_that_fails_its_share_makes_every_rank_fail_instead_of_waiting(tmp_path, monkeypatch):
    import lit_dist.data.discovery as discovery

    make_many_images(tmp_path / "imgs")
    real_read = discovery._read_sizes
    this_thread = threading.local()

    def failing_on_rank_1(fs, paths, *args):
        if this_thread.rank == 1:
            raise OSError("disk on fire")
        return real_read(fs, paths, *args)

    monkeypatch.setattr(discovery, "_read_sizes", failing_on_rank_1)

    def on_rank(comm):
        this_thread.rank = comm.rank
        try:
            scan_folder(str(tmp_path / "imgs"), progress=False, comm=comm)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "finished"

    outcomes = on_ranks(2, on_rank)
    assert outcomes[1] == "OSError: disk on fire"
    assert outcomes[0].startswith("RuntimeError: reading the image headers under") and "rank 1: OSError: disk on fire" in outcomes[0]


def test_a_damaged_cached_index_costs_a_rescan_not_the_run(tmp_path):
    make_images(tmp_path / "imgs")
    cache = tmp_path / "index.parquet"
    cache.write_bytes(b"PAR1 torn by a crash")
    load_or_scan(str(tmp_path / "imgs"), str(cache), progress=False)
    assert pq.read_table(cache).equals(scan_folder(str(tmp_path / "imgs"), progress=False))


@pytest.mark.parametrize("made", [False, True], ids=["missing", "empty"])
def test_a_folder_without_images_is_a_data_error_not_an_empty_table(tmp_path, made):
    from lit_dist.errors import DataError

    root = tmp_path / "imgs"
    if made:
        root.mkdir()
        (root / "notes.txt").write_text("no image here")
    expected = f"no images under {root} (files ending in .jpg" if made else f"{root} does not exist"
    with pytest.raises(DataError, match=r"^" + re.escape(expected)):
        scan_folder(str(root))
