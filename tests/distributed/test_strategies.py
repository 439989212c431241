"""DDP and FSDP2 on two CPU processes: same losses as one process, and checkpoints that export anywhere."""

import hashlib
import json
import pickle

import numpy as np
import pytest
import torch

from lit_dist.ckpt.io import TRUST
from lit_dist.ckpt.store import MARKER, STATE
from lit_dist.ckpt.vetting import vet
from lit_dist.model.nets import SimpleCNN
from tests.conftest import CONFIGS, lit_dist, quickstart_args
from tests.helpers.planted import Planted

pytestmark = pytest.mark.distributed

# GroupNorm: per-sample statistics, so splitting a global batch over ranks changes nothing.
# Same global batch (16), seed and data order in every run; 12 steps.
COMMON = ["--model.net.init_args.norm", "group",
          "--trainer.max_steps", "12", "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
          "--trainer.enable_progress_bar", "false", "--data.num_workers", "0", "--model.warmup_steps", "0",
          "--model.lr_scaling", "none", "--trainer.callbacks+=tests.helpers.recorder.LossRecorder"]


def run(tmp_path, demo_data, name, devices, per_device, *extra):
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data), *COMMON, "--run.run_id", name, "--trainer.devices",
                   str(devices), "--data.batch_size_per_device", str(per_device), *extra, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    run_dir = tmp_path / "quickstart" / name
    losses = [json.loads((run_dir / f"losses-rank{r}.json").read_text()) for r in range(devices)]
    return run_dir, np.mean(losses, axis=0)  # equal per-rank batches: the mean is the global loss


@pytest.fixture(scope="module")
def single(tmp_path_factory, demo_data):
    return run(tmp_path_factory.mktemp("single"), demo_data, "single", 1, 16)


@pytest.mark.parametrize("strategy", [
    ["--trainer.strategy", "ddp"],
    ["--config", str(CONFIGS / "fsdp2.yaml")],
    ["--config", str(CONFIGS / "fsdp2.yaml"), "--trainer.strategy.init_args.activation_checkpointing", "true"],
], ids=["ddp", "fsdp2", "fsdp2-activation-checkpointing"])
def test_two_processes_follow_the_single_process_loss_curve(strategy, single, tmp_path, demo_data):
    _, reference = single
    run_dir, losses = run(tmp_path, demo_data, "two", 2, 8, *strategy)
    # Tolerance: float32 reductions in another order (all-reduce / reduce-scatter) drift by ~1e-6 per step.
    np.testing.assert_allclose(losses, reference, rtol=1e-3, atol=1e-4)
    # The consolidated model.pt of the two-process run equals the single process's weights too.
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(single[0] / "model.pt", weights_only=True)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4)


def test_fsdp2_sharded_checkpoint_exports_to_a_bare_model(tmp_path, demo_data):
    run_dir, _ = run(tmp_path, demo_data, "fsdp2", 2, 8, "--config", str(CONFIGS / "fsdp2.yaml"),
                     "--trainer.max_steps", "-1", "--trainer.max_epochs", "1")
    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((checkpoint / "COMPLETE.json").read_text())
    shards = [f for f in manifest["files"] if f.endswith(".distcp")]
    assert len(shards) == 2, f"each of the 2 ranks writes its own shard: {manifest['files']}"
    out = lit_dist("export", str(checkpoint), "--output", str(tmp_path / "exported.pt"))
    assert out.returncode == 0, out.stderr
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    at_end = torch.load(run_dir / "model.pt", weights_only=True)
    x = torch.randn(3, 3, 24, 40)
    outputs = []
    for state in (exported, at_end):
        net = SimpleCNN(num_classes=4, norm="group").eval()
        net.load_state_dict(state)  # strict: every key, no lit-dist needed
        outputs.append(net(x))
    torch.testing.assert_close(outputs[0], outputs[1])

    # torch unpickles a sharded checkpoint's `.metadata` and non-tensor entries in full: a resume vets them
    # first. The run's own pass (an optimizer's state as FSDP2 saves it); a planted `.metadata` is refused.
    vet(str(checkpoint / STATE), TRUST)
    marker = tmp_path / "marker"
    metadata = checkpoint / STATE / ".metadata"
    metadata.write_bytes(pickle.dumps(Planted(marker)))
    data = metadata.read_bytes()
    manifest["files"][f"{STATE}/.metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MARKER).write_text(json.dumps(manifest))
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data), *COMMON, "--run.run_id", "sent", "--trainer.devices",
                   "2", "--config", str(CONFIGS / "fsdp2.yaml"), "--ckpt_path", str(checkpoint), timeout=300)
    assert out.returncode == 3, out.stderr[-4000:]
    assert f"lit-dist: error: {metadata} holds builtins.exec" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not marker.exists(), "the planted object ran"


def test_fsdp2_under_bf16_mixed_gathers_bf16_and_keeps_float32_weights(single, tmp_path, demo_data):
    run_dir, losses = run(tmp_path, demo_data, "bf16", 2, 8, "--config", str(CONFIGS / "fsdp2.yaml"),
                          "--trainer.precision", "bf16-mixed", "--trainer.callbacks+=tests.helpers.recorder.GatheredDtype")
    for rank in range(2):
        assert json.loads((run_dir / f"gathered-rank{rank}.json").read_text()) == ["torch.bfloat16"]
    # bf16 keeps ~3 significant digits: the curve follows the float32 one loosely.
    np.testing.assert_allclose(losses, single[1], rtol=0.05)
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}


def test_fsdp2_starts_every_shard_from_model_init_weights(single, tmp_path, demo_data):
    # lr 0: the run's weights stay what it started from, and its consolidated model.pt gathers every rank's shards.
    start = single[0] / "model.pt"
    run_dir, _ = run(tmp_path, demo_data, "from-weights", 2, 8, "--config", str(CONFIGS / "fsdp2.yaml"),
                     "--model.init_weights", str(start), "--model.optimizer.init_args.lr", "0",
                     "--trainer.max_steps", "1")
    began, ended = (torch.load(path, weights_only=True) for path in (start, run_dir / "model.pt"))
    assert began.keys() == ended.keys()
    for key in began:
        torch.testing.assert_close(ended[key], began[key], rtol=0, atol=0, msg=key)
