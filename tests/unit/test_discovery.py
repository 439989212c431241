import os

import pyarrow.parquet as pq
from PIL import Image

from lit_dist.data.discovery import load_or_scan, scan_folder
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


def test_index_command_writes_a_table_training_can_read(tmp_path):
    make_images(tmp_path / "imgs")
    out = lit_dist("index", str(tmp_path / "imgs"), "--output", str(tmp_path / "meta.parquet"), "--labels_from_folders", "true")
    assert out.returncode == 0, out.stderr
    assert "4 images" in out.stdout and "1 unreadable" in out.stdout
    from lit_dist.data.metadata import read_metadata

    meta = read_metadata(str(tmp_path / "meta.parquet"))
    assert len(meta) == 3 and meta.bad.counts == {"missing or non-positive width/height": 1}
