"""The quickstart exactly as README.md gives it, from a folder without the demo data."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import CONFIGS, lit_dist


def check_quickstart_output(out, cwd):
    assert out.returncode == 0, out.stderr[-4000:]
    acc = float(re.search(r"fit finished: .*val/acc (\d\.\d+)", out.stdout).group(1))
    assert acc >= 0.90, out.stdout[-2000:]
    run_dir = re.search(r"run directory: (\S+)", out.stdout).group(1)
    assert f"tensorboard --logdir {run_dir}" in out.stdout
    run = cwd / run_dir
    assert (run / "config.yaml").is_file() and list((run / "checkpoints").glob("step-*/COMPLETE.json"))
    events = EventAccumulator(str(run))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/acc", "val/loss", "val/acc", "train/lr", "throughput/samples_per_s",
            "throughput/samples_per_s_per_device", "throughput/tflops_per_device", "throughput/data_wait"} <= tags
    assert any(tag.startswith("throughput/samples_per_s_bucket_") for tag in tags)
    assert events.Scalars("val/acc")[-1].value == pytest.approx(acc, abs=1e-4)


@pytest.mark.slow
def test_quickstart_trains_to_90_percent_on_cpu(tmp_path):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), cwd=tmp_path, timeout=300)
    check_quickstart_output(out, tmp_path)
    assert (tmp_path / "data" / "shapes" / "metadata.parquet").is_file(), "demo data generated on first use"
    # Its output goes to a pipe, as under Slurm to a file: plain lines, no progress bar redraws.
    log = out.stdout + out.stderr
    steps = int(re.findall(r"lit-dist: step (\d+)/", log)[-1])
    assert steps == 1245 and "samples/s" in log and "data wait" in log
    assert len(log.encode()) <= 5000 * steps / 1000, f"{len(log.encode())} bytes of log for {steps} steps"
    assert log.count("\r") <= steps / 100, f"{log.count(chr(13))} carriage returns for {steps} steps"
