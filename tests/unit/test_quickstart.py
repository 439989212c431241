"""The quickstart exactly as README.md gives it, from a folder without the demo data."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import CONFIGS, lit_dist


def check_quickstart_output(out, cwd):
    assert out.returncode == 0, out.stderr[-4000:]
    acc = float(re.search(r"val/acc (\d\.\d+)", out.stdout).group(1))
    assert acc >= 0.90, out.stdout[-2000:]
    run_dir = re.search(r"run directory: (\S+)", out.stdout).group(1)
    assert f"tensorboard --logdir {run_dir}" in out.stdout
    run = cwd / run_dir
    assert (run / "config.yaml").is_file() and list((run / "checkpoints").glob("step-*/COMPLETE.json"))
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "train/lr", "throughput/samples_per_s"} <= tags
    assert events.Scalars("val/acc")[-1].value == pytest.approx(acc, abs=1e-4)


@pytest.mark.slow
def test_quickstart_trains_to_90_percent_on_cpu(tmp_path):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), cwd=tmp_path, timeout=300)
    check_quickstart_output(out, tmp_path)
    assert (tmp_path / "data" / "shapes" / "metadata.parquet").is_file(), "demo data generated on first use"
