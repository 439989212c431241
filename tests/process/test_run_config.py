"""`lit-dist validate`, `test` and `predict` of a finished run, given the run directory's own config.yaml as a user
reaches for it: each works as it is, says which weights it used (the run's weight average, as its own last
validation did), writes its own config beside fit's instead of over it, and a config saved by another command
works too, with the keys it leaves unused named in one line."""

import re

import pytest

from tests.conftest import lit_dist, quickstart_args

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def finished(tmp_path_factory, demo_data):
    """(run directory, the run's last val/loss): a quickstart of 12 steps with a weight average, validated at its
    end, a checkpoint there."""
    root = tmp_path_factory.mktemp("runs")
    args = quickstart_args(root, demo_data, trainer__max_steps=12, trainer__val_check_interval=12,
                           trainer__limit_val_batches=4, trainer__enable_progress_bar=False, data__num_workers=0,
                           data__batch_size_per_device=16, checkpoint__every_n_epochs=None, export__filename=None)
    out = lit_dist("fit", *args, "--model.ema.decay", "0.8")
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = next((root / "quickstart").iterdir())
    loss = float(re.findall(r"validation at step 12: val/acc [\d.]+, val/loss ([\d.]+)", out.stdout + out.stderr)[-1])
    return run_dir, loss


def command(name, run_dir, *extra, config="config.yaml"):
    return lit_dist(name, "--config", str(run_dir / config), "--ckpt_path",
                    str(run_dir / "checkpoints" / "step-000000012"), *extra)


def test_validate_takes_the_runs_own_config_and_evaluates_its_weight_average(finished):
    run_dir, loss = finished
    saved = (run_dir / "config.yaml").read_bytes()
    out = command("validate", run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(re.search(r"validate finished: val/acc [\d.]+, val/loss ([\d.]+)", out.stdout).group(1)) == loss
    assert "weights:       the weight average of model.ema (12 updates)" in out.stdout, out.stdout
    assert f"run directory: {run_dir} (the run's own" in out.stdout, out.stdout
    assert (run_dir / "config.yaml").read_bytes() == saved, "fit's config.yaml was overwritten"
    assert (run_dir / "config-validate.yaml").is_file()

    raw = command("validate", run_dir, "--model.ema.evaluate", "false")
    assert raw.returncode == 0, raw.stderr[-3000:]
    assert "weights:       the trained weights (model.ema.evaluate is false)" in raw.stdout, raw.stdout
    assert float(re.search(r"val/loss ([\d.]+)", raw.stdout).group(1)) != loss


def test_test_takes_the_runs_own_config(finished):
    run_dir, _ = finished
    out = command("test", run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "test finished: test/acc" in out.stdout and "the weight average of model.ema" in out.stdout, out.stdout


def test_predict_takes_the_runs_own_config_and_one_another_command_saved(finished):
    run_dir, _ = finished
    out = command("predict", run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"predictions written to {run_dir}" in out.stdout and "the weight average" in out.stdout, out.stdout
    assert "leaves unused" not in out.stdout  # fit's config holds nothing predict lacks
    (run_dir / "config-test.yaml").exists() or command("test", run_dir)
    out = command("predict", run_dir, config="config-test.yaml")  # test's config holds its `verbose`
    assert out.returncode == 0, out.stderr[-3000:]
    assert "lit-dist: predict leaves unused the config's verbose (keys of test and validate)" in out.stdout
