"""A rank that cannot see the checkpoint folder rank 0 writes stops the run at the start, on every rank."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed


def test_a_rank_without_the_shared_folder_fails_early_with_a_clear_error(tmp_path, demo_data):
    out = subprocess.run([sys.executable, "-m", "tests.helpers.blind_rank", str(tmp_path), str(demo_data)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: lit-dist: error: checkpoint.dirpath: {tmp_path / f'node{rank}'} is not shared: rank 1 on" in out.stdout
    assert "shared filesystem" in out.stdout
    assert not list(tmp_path.rglob("step-*")), "nothing was trained or saved"
