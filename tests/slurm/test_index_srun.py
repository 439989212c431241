"""``lit-dist index`` as two tasks of a real Slurm job step: each reads half of the headers, rank 0 writes
the table a single process writes."""

import subprocess

import pyarrow.parquet as pq

from lit_dist.data.discovery import scan_folder
from tests.conftest import REPO


def test_index_under_srun_splits_the_header_reads_and_writes_the_one_process_table(slurm, tmp_path, demo_data):
    out = subprocess.run(["srun", "-N1", "--ntasks-per-node=2", slurm["LIT_DIST"], "index", str(demo_data.parent),
                          "--output", str(tmp_path / "index.parquet"), "--labels_from_folders", "true"],
                         cwd=REPO, env=slurm, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("lit-dist index: 400 images") == 1 and "by 2 processes" in out.stdout
    # rank 0's progress, its share only: every other file
    assert "200 of 200 img (100%), done in" in out.stdout and "of 400 img" not in out.stdout, out.stdout[-2000:]
    alone = scan_folder(str(demo_data.parent), labels_from_folders=True, progress=False)
    assert pq.read_table(tmp_path / "index.parquet").equals(alone)
