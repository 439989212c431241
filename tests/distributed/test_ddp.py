"""Two real processes over gloo, started by Lightning exactly as `--trainer.devices 2` does for a user."""

import json

import pytest

from tests.conftest import CONFIGS, lit_dist, quickstart_args
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


def test_each_rank_draws_its_own_noise_and_timesteps(tmp_path, demo_data):
    # Every rank is seeded alike so that they build the same model; a generative objective's noise, timesteps and
    # caption dropout come from the torch stream, which must then differ from rank to rank.
    args = quickstart_args(tmp_path, demo_data, trainer__devices=2, trainer__strategy="ddp", trainer__max_steps=3,
                           data__batch_size_per_device=8, data__num_workers=0, trainer__limit_val_batches=0,
                           trainer__enable_progress_bar=False, checkpoint__every_n_epochs=None, run__run_id="r")
    out = lit_dist("fit", *args, "--model.net", "lit_dist.model.nets.TinyUNet", "--model.net.init_args.channels", "[8, 16]",
                   "--model.net.init_args.num_classes", "4", "--model.objective", "lit_dist.model.objectives.FlowMatching",
                   "--model.objective.init_args.condition", "label", "--model.objective.init_args.null_label", "4",
                   "--samples.at_end", "false", "--trainer.callbacks+=tests.helpers.recorder.RandomStreams", timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = tmp_path / "quickstart" / "r"
    streams = [json.loads((run_dir / f"streams-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert len(streams[0]) == 3 and all(a != b for a, b in zip(*streams, strict=True)), streams
