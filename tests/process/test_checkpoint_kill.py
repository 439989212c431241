"""SIGKILL during saves, many times: no torn file at a final path, and ``ckpt_path: auto`` always resumes.

10 kills by default (about 30 s; ``LIT_DIST_KILLS=200`` for a longer run). Half of them land a
random moment into a save, a quarter a random moment after the round's first new checkpoint, the
rest at any moment (start-up, loading, training, saving); one round in three saves asynchronously. See tests/helpers/kill_driver.py.
"""

import json
import os
import subprocess
import sys

import pytest

from lit_dist.ckpt.store import CheckpointStore
from tests.conftest import REPO, lit_dist
from tests.helpers.kill_driver import ARGS

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_killed_saves_never_leave_a_torn_checkpoint_and_training_resumes(tmp_path, demo_data):
    kills = int(os.environ.get("LIT_DIST_KILLS", 10))
    out = subprocess.run([sys.executable, "-m", "tests.helpers.kill_driver", str(tmp_path), str(demo_data), str(kills), "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=60 + 10 * kills)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    print(summary)
    assert summary["kills"] == kills
    assert summary["problems"] == []
    assert summary["during_save"] >= kills // 3, f"too few kills landed during a save: {summary}"
    assert summary["checkpoints_seen"] >= 2, "training made no progress between kills"

    folder = tmp_path / "quickstart" / "kill" / "checkpoints"
    newest = CheckpointStore(str(folder)).find_valid()[0]
    step = int(newest.split("-")[1])
    final = lit_dist(*ARGS, "--run.root_dir", str(tmp_path), "--data.metadata", str(demo_data),
                     "--trainer.max_steps", str(step + 2))
    assert final.returncode == 0, final.stderr[-3000:]
    assert f"resuming from {folder / newest}" in final.stdout + final.stderr
    assert CheckpointStore(str(folder)).find_valid()[0] == f"step-{step + 2:09d}"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "the resumed run cleans what kills left"
