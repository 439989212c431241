"""`lit-dist scale` on 1 and 2 CPU processes: timed fits, the table, scaling.json and the plot."""

import json
import re

import pytest
from PIL import Image

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.distributed


@pytest.mark.serial  # measures speed-up
def test_scale_measures_one_and_two_processes_and_reports_speedup_and_efficiency(tmp_path, demo_data):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8)
    out = lit_dist("scale", *args, "--devices", "1,2", "--steps", "36")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {int(d): (float(s.replace(",", "")), float(x), int(e))
            for d, s, x, e in re.findall(r"^\s+1\s+(\d+)\s+([\d,.]+)\s+([\d.]+)\s+(\d+)%$", out.stdout, re.M)}
    assert sorted(rows) == [1, 2], out.stdout
    sizes = json.loads((tmp_path / "scale" / "scaling.json").read_text())
    assert [s["devices"] for s in sizes] == [1, 2] and all(s["windows"] == 5 for s in sizes)
    one, two = sizes
    assert one["samples_per_s"] > 0 and two["samples_per_s"] > 0
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["samples_per_s"] / (2 * one["samples_per_s"]))
    assert rows[2][2] == round(two["efficiency"] * 100) and rows[1][1] == 1.0
    # Each size is a real run of its own (with its config and TensorBoard files).
    assert "devices: '2'" in (tmp_path / "scale" / "devices-2" / "config.yaml").read_text()
    with Image.open(tmp_path / "scale" / "scaling.png") as image:
        assert image.format == "PNG"


def test_a_timed_fit_that_fails_ends_scale_with_its_exit_code_and_reason(tmp_path, demo_data):
    # 2 x 16 samples per global batch: a bucket of the demo data is too small, a data error (exit 3).
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=16)
    out = lit_dist("scale", *args, "--devices", "1,2", "--steps", "12")
    assert out.returncode == ExitCode.DATA_ERROR, out.stderr[-2000:]
    assert "the timed fit on 2 devices failed (exit 3)" in out.stderr and "fewer than one global batch" in out.stderr


def test_scale_refuses_bad_sizes_and_too_few_steps_with_a_config_error(tmp_path, demo_data):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0)
    bad = lit_dist("scale", *args, "--devices", "0,2")
    assert bad.returncode == ExitCode.CONFIG_ERROR and "--devices '0,2'" in bad.stderr, bad.stderr[-2000:]
    two = lit_dist("scale", *args, "--nodes", "1,2", "--devices", "1,2")
    assert two.returncode == ExitCode.CONFIG_ERROR and "one number, the devices (tasks) per node" in two.stderr
    short = lit_dist("scale", *args, "--steps", "5")
    assert short.returncode == ExitCode.CONFIG_ERROR and "--steps 5: at least 12" in short.stderr, short.stderr[-2000:]
