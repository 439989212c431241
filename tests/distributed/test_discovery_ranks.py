"""The folder scan split over two processes: ``lit-dist index`` under torchrun, and ``data.scan_root`` in
a two-process DDP run, each write the table a single process writes, row for row."""

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from lit_dist.data.discovery import scan_folder
from tests.conftest import REPO, lit_dist, quickstart_args
from tests.helpers.ports import free_port

pytestmark = pytest.mark.distributed
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """201 demo PNGs in four class folders, a JPEG turned by its EXIF orientation and an unreadable file."""
    from lit_dist.data.demo.shapes import create_shapes_dataset

    root = tmp_path_factory.mktemp("scan") / "shapes"
    create_shapes_dataset(str(root / "metadata.parquet"), num_images=201, seed=1)
    turned = Image.new("RGB", (50, 30))
    exif = turned.getexif()
    exif[0x0112] = 6  # displayed as 30 x 50
    turned.save(root / "circle" / "turned.jpg", exif=exif)
    (root / "square" / "broken.jpg").write_bytes(b"not a jpeg")
    return root


def torchrun_index(folder: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}", "-m", "lit_dist",
                           "index", str(folder), "--output", str(output), "--labels_from_folders", "true"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_index_under_torchrun_writes_the_one_process_table(tmp_path, image_folder):
    one = lit_dist("index", str(image_folder), "--output", str(tmp_path / "one.parquet"), "--labels_from_folders", "true")
    assert one.returncode == 0, one.stderr[-3000:]
    two = torchrun_index(image_folder, tmp_path / "two.parquet")
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    assert two.stdout.count("lit-dist index: 203 images") == 1 and "by 2 processes" in two.stdout  # rank 0 alone
    # rank 0's progress, its share only: every other file
    assert "102 of 102 img (100%), done in" in two.stdout and "of 203 img" not in two.stdout, two.stdout[-2000:]
    table = pq.read_table(tmp_path / "two.parquet")
    assert table.equals(pq.read_table(tmp_path / "one.parquet"))
    # A rerun reuses the rows of unchanged files and reads only the headers of new ones, still split.
    folder = tmp_path / "grown"
    shutil.copytree(image_folder, folder, copy_function=shutil.copy2)  # copy2 keeps the mtimes
    shutil.copy2(tmp_path / "two.parquet", tmp_path / "grown.parquet")
    Image.new("RGB", (7, 9)).save(folder / "cross" / "new.png")
    again = torchrun_index(folder, tmp_path / "grown.parquet")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert pq.read_table(tmp_path / "grown.parquet").equals(scan_folder(str(folder), labels_from_folders=True, progress=False))


def test_a_ddp_run_splits_the_scan_of_scan_root_and_caches_the_one_process_table(tmp_path, image_folder):
    cache = tmp_path / "index.parquet"
    out = lit_dist("validate", *quickstart_args(tmp_path, data__metadata=None, data__create_demo_if_missing=False,
                                                data__scan_root=image_folder, data__labels_from_folders=True,
                                                data__index_cache=cache, data__num_workers=0, trainer__devices=2,
                                                trainer__strategy="ddp"), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "val/acc" in out.stdout
    # The progress is rank 0's: 102 of the 203 headers (every other file), not all of them.
    assert "102 of 102 img (100%), done in" in out.stdout and "of 203 img" not in out.stdout, out.stdout[-2000:]
    assert pq.read_table(cache).equals(scan_folder(str(image_folder), labels_from_folders=True, progress=False))
