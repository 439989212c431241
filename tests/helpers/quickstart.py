"""What a finished quickstart run must show, whichever tier ran it (one process, or two over DDP)."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


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
