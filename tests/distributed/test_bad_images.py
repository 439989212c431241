"""Unreadable images across two ranks: replaced while rare, and a run drowning in them stops on both ranks."""

import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.distributed


def corrupted_copy(demo_data, tmp_path, every_nth):
    root = tmp_path / "shapes"
    shutil.copytree(demo_data.parent, root)
    images = sorted(root.rglob("*.png"))
    for path in images[::every_nth]:
        path.write_bytes(b"this is not a png")
    return root / "metadata.parquet", len(images[::every_nth])


def fit(metadata, tmp_path, *extra):
    return lit_dist("fit", *quickstart_args(tmp_path, metadata, data__batch_size_per_device=8, data__num_workers=0,
                                            trainer__devices=2, trainer__strategy="ddp",
                                            trainer__enable_progress_bar=False), *extra, timeout=240)


def test_many_bad_images_stop_both_ranks_with_the_data_error_code(demo_data, tmp_path):
    metadata, _ = corrupted_copy(demo_data, tmp_path, every_nth=2)  # half the images are garbage
    out = fit(metadata, tmp_path, "--trainer.max_epochs", "20", "--run.run_id", "r",
              "--trainer.callbacks+=tests.helpers.recorder.StopStep")
    assert out.returncode == ExitCode.DATA_ERROR, out.stderr[-3000:]
    assert "could not be read, more than data.max_bad_fraction = 0.01" in out.stderr
    assert "Traceback" not in out.stderr
    stops = [json.loads((tmp_path / "quickstart" / "r" / f"stop-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert stops[0] == stops[1] and stops[0]["error"] == "DataError", f"both ranks stop at the same step: {stops}"


def test_a_few_bad_images_are_replaced_counted_and_logged_once(demo_data, tmp_path):
    metadata, corrupted = corrupted_copy(demo_data, tmp_path, every_nth=80)
    out = fit(metadata, tmp_path, "--trainer.max_epochs", "2", "--data.max_bad_fraction", "0.5", "--run.run_id", "r")
    assert out.returncode == 0, out.stderr[-3000:]
    # Fewer steps than log_every_n_steps (50), and still in TensorBoard: the count goes straight to the logger.
    events = EventAccumulator(str(tmp_path / "quickstart" / "r"))
    events.Reload()
    counts = [e.value for e in events.Scalars("data/bad_samples")]
    assert counts[0] >= 0 and counts[-1] > 0 and counts == sorted(counts)
    warned = [line for line in out.stderr.splitlines() if "cannot read" in line]
    assert warned and len(warned) == len(set(warned)), "each bad file is reported once per process"
