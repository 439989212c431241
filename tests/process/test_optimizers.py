"""Optimizers users name by class_path: Prodigy, which sets its own step size, trains the quickstart at lr 1.0 with
no tuning, and `lit-dist plan` says which of a config's settings do not fit it or a schedule-free optimizer."""

import re

import pytest

from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.process
pytest.importorskip("prodigyopt")
PRODIGY = ["--model.optimizer", "prodigyopt.Prodigy", "--model.optimizer.lr", "1.0"]


@pytest.mark.slow
def test_prodigy_at_lr_1_trains_the_quickstart_to_95_percent(tmp_path):
    quickstart = ["--config", str(CONFIGS / "quickstart.yaml")]
    # The quickstart's own lr_scaling (sqrt) and warmup (20 steps) do not fit an optimizer that sets its step size.
    out = lit_dist("plan", *quickstart, *PRODIGY, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "learning rate       1 (Prodigy estimates its own step size: not scaled)" in out.stdout, out.stdout
    assert "model.lr_scaling sqrt is not applied" in out.stdout and "safeguard_warmup: true" in out.stdout
    out = lit_dist("fit", *quickstart, *PRODIGY, "--model.lr_scaling", "none", "--model.warmup_steps", "0",
                   cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    accuracies = [float(a) for a in re.findall(r"val/acc ([\d.]+)", log)]
    assert len(accuracies) >= 15 and accuracies[-1] >= 0.95, accuracies  # 0.9965 here, as AdamW's quickstart
    assert "estimates its own step size" not in log, "a config that fits Prodigy is told nothing"


def test_plan_tells_a_schedule_free_run_of_its_scheduler_and_refuses_a_weight_average(tmp_path):
    pytest.importorskip("schedulefree")
    quickstart = ["--config", str(CONFIGS / "quickstart.yaml"), "--model.optimizer", "schedulefree.AdamWScheduleFree"]
    out = lit_dist("plan", *quickstart, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "AdamWScheduleFree is schedule-free: it needs no decay of the lr, and model.lr_scheduler" in out.stdout
    out = lit_dist("plan", *quickstart, "--model.lr_scheduler", "null", "--model.ema.decay", "0.99", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert "model.ema would average the training point instead" in out.stdout
    assert "needs no decay" not in out.stdout, "a constant lr is told nothing"


def test_bitsandbytes_under_fsdp2_is_refused_before_any_process_starts(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--config", str(CONFIGS / "fsdp2.yaml"),
                   "--trainer.devices", "2", "--model.optimizer", "bitsandbytes.optim.AdamW8bit",
                   "--run.root_dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "model.optimizer AdamW8bit (bitsandbytes) steps plain tensors, and FSDP2's parameters are DTensors" \
        in out.stderr
    assert "Traceback" not in out.stderr and "Initializing distributed" not in out.stdout + out.stderr
