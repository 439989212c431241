"""The quickstart exactly as README.md gives it, from a folder without the demo data."""

import re

import pytest

from tests.conftest import CONFIGS, lit_dist
from tests.helpers.quickstart import check_quickstart_output

pytestmark = pytest.mark.process


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
