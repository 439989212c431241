"""Two real processes over gloo, started by Lightning exactly as `--trainer.devices 2` does for a user."""

import pytest

from tests.conftest import CONFIGS, lit_dist
from tests.helpers.quickstart import check_quickstart_output

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_quickstart_with_two_ddp_processes_reaches_90_percent(tmp_path):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--trainer.devices", "2",
                   "--trainer.strategy", "ddp", cwd=tmp_path, timeout=400)
    check_quickstart_output(out, tmp_path)
    assert "effective batch 64 = 32 per device x 2 devices" in out.stderr


def test_uneven_validation_does_not_hang_and_counts_every_sample(tmp_path, demo_data):
    # 400 rows with val_fraction 0.5 and batch 7 over 2 ranks: the ranks own different batch counts.
    out = lit_dist("validate", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
                   "--data.batch_size_per_device", "7", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                   "--run.root_dir", str(tmp_path), "--data.num_workers", "0", timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "val/acc" in out.stdout
