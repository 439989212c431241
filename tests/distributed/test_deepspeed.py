"""DeepSpeed on two CPU processes (lit_dist.strategies.deepspeed.DeepSpeedStrategy): every preset trains and validates,
with a weight average (model.ema: whole under ZeRO-1/2, each rank's partition under ZeRO-3);
ZeRO-2 and ZeRO-3 runs killed mid-epoch (SIGKILL) resume to the uninterrupted run's weights, bitwise; a preempted
ZeRO-3 run saves at a step boundary and resumes to them too, and rotation never deletes the folder it resumed
from; the consolidated model (model.pt at the end, `lit-dist export` of a ZeRO-3 checkpoint) loads into the plain
network and predicts what the sharded model predicted."""

import json
import os
import shutil
import time

import pytest
import torch

from lit_dist.ckpt.export import load_checkpoint_state, network_state
from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore, checkpoint_name
from lit_dist.errors import ExitCode
from lit_dist.model.nets import SimpleCNN
from tests.conftest import CONFIGS, lit_dist, quickstart_args

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")

PRESETS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
AVERAGED = PRESETS  # model.ema: a whole average per rank under ZeRO-1/2, its partition under ZeRO-3
KILL, END, EVERY = 6, 8, 4  # ~25 steps per epoch at a global batch of 16: all mid-epoch


def fit(tmp_path, demo_data, preset, run_id, *extra, env=None):
    args = quickstart_args(tmp_path, demo_data, CONFIGS / f"deepspeed_{preset}.yaml", trainer__devices=2,
                           trainer__accelerator="cpu", data__batch_size_per_device=8, data__num_workers=0,
                           trainer__max_steps=END, trainer__val_check_interval=4, trainer__limit_val_batches=2,
                           trainer__enable_progress_bar=False, checkpoint__every_n_steps=EVERY,
                           checkpoint__every_n_epochs=None, run__run_id=run_id)
    ema = ["--model.ema.decay", "0.9", "--model.ema.start_step", "3"] if preset in AVERAGED else []
    return lit_dist("fit", *args, *ema, *extra, timeout=300, env=env), tmp_path / "quickstart" / run_id


def plain_net(state: dict) -> SimpleCNN:
    net = SimpleCNN(num_classes=4).eval()
    net.load_state_dict(state)  # strict: every key, no DeepSpeed needed
    return net


def weights(run_dir) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs {what}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, demo_data):
    """``(result, run dir)`` of each preset's uninterrupted run, run once: the preset test checks it, the resume
    tests compare with its weights. ZeRO-1 asks for asynchronous saves too, to be told they stay synchronous;
    PredictAtEnd runs the model in eval mode without gradients, so the weights are those of a plain run."""
    runs = {}

    def get(preset: str):
        if preset not in runs:
            extra = ["--checkpoint.async_save", "true"] if preset == "zero1" else []
            runs[preset] = fit(tmp_path_factory.mktemp(preset), demo_data, preset, "run",
                               "--trainer.callbacks+=tests.helpers.recorder.PredictAtEnd",
                               "--trainer.callbacks.swap_step", str(END - 1), *extra)
        out, run_dir = runs[preset]
        assert out.returncode == 0, out.stderr[-4000:]
        return out, run_dir

    return get


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_validates_and_writes_a_plain_model(preset, uninterrupted):
    out, run_dir = uninterrupted(preset)
    if preset == "zero1":
        assert "checkpoint.async_save is for DDP, single devices and FSDP2; DeepSpeedStrategy saves synchronously" \
               in out.stderr
    assert "no validation metrics" not in out.stdout + out.stderr and "val/acc" in out.stdout + out.stderr
    newest = run_dir / "checkpoints" / checkpoint_name(END)
    assert (newest / MARKER).is_file() and (newest / STATE).is_dir(), "a DeepSpeed folder, marked complete"
    net = plain_net(weights(run_dir))
    x = torch.randn(3, 3, 24, 40, generator=torch.Generator().manual_seed(0))
    sharded = torch.tensor(json.loads((run_dir / "predictions-rank0.json").read_text()))
    with torch.no_grad():
        torch.testing.assert_close(net(x), sharded)
    if preset in AVERAGED:  # validated on the average, saved beside the raw weights (fp32, whatever the weights)
        state = load_checkpoint_state(str(newest))
        averaged = [k for k in state if k.startswith("ema.average.")]
        assert len(averaged) == len(list(SimpleCNN(num_classes=4).parameters())), "every parameter, no statistics"
        assert any(not torch.equal(state[k], state["net." + k.removeprefix("ema.average.")]) for k in averaged)
        # The average swapped into the strategy's model predicts as the exported average does; mid-run, swapped in
        # it changes the outputs and swapped out they are the raw weights' again (the model.pt check above).
        swapped = torch.tensor(json.loads((run_dir / "predictions-ema-rank0.json").read_text()))
        with torch.no_grad():
            torch.testing.assert_close(plain_net(network_state(state, ema=True))(x), swapped)
        mid = json.loads((run_dir / "swap-rank0.json").read_text())
        assert mid["ema"] != mid["raw"], "the swap did not reach the model"
    if preset.startswith("zero3"):  # each rank holds the average of its partition only: half the model, padding aside
        params = sum(p.numel() for p in SimpleCNN(num_classes=4).parameters())
        for rank in range(2):
            held = torch.load(newest / STATE / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                              weights_only=False, mmap=True)["module"]
            averaged = sum(v.numel() for k, v in held.items() if k.startswith("ema.average."))
            assert params / 2 <= averaged <= params / 2 + 64, (rank, averaged, params)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_a_run_killed_mid_epoch_resumes_to_the_uninterrupted_weights(preset, tmp_path, demo_data, uninterrupted):
    straight = weights(uninterrupted(preset)[1])
    killed, run_dir = fit(tmp_path, demo_data, preset, "killed", "--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep",
                          "--trainer.callbacks.step", str(KILL))
    assert killed.returncode == ExitCode.PROCESS_DIED, killed.stderr[-4000:]
    resumed, _ = fit(tmp_path, demo_data, preset, "killed")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / checkpoint_name(EVERY)}" in resumed.stdout + resumed.stderr
    assert_equal(straight, weights(run_dir), "after the resume")
    if preset in AVERAGED:  # the weight average too
        newest = [load_checkpoint_state(str(r / "checkpoints" / checkpoint_name(END)))
                  for r in (uninterrupted(preset)[1], run_dir)]
        averages = [{k: v for k, v in n.items() if k.startswith("ema.")} for n in newest]
        assert averages[0], "the average is in the checkpoint"
        assert_equal(*averages, "in the average")
    if preset == "zero3":  # and a ZeRO-3 checkpoint exports to the same plain model
        exported = tmp_path / "exported.pt"
        out = lit_dist("export", str(run_dir / "checkpoints" / checkpoint_name(END)), "--output", str(exported))
        assert out.returncode == 0, out.stderr[-3000:]
        assert_equal(straight, torch.load(exported, weights_only=True), "in the export")


def test_a_preempted_run_saves_at_a_step_boundary_and_rotation_keeps_what_it_resumed_from(tmp_path, demo_data,
                                                                                            uninterrupted):
    straight = weights(uninterrupted("zero3")[1])
    # SIGUSR1 on rank 1 after step 2; with a run-control window of 2 steps both ranks stop together at most 3 steps later.
    stopped, run_dir = fit(tmp_path, demo_data, "zero3", "pre", "--control.sync_every_n_steps", "2",
                           "--checkpoint.every_n_steps", "100",
                           "--trainer.callbacks+=tests.helpers.recorder.SignalRankAtStep", "--trainer.callbacks.step", "2")
    assert stopped.returncode == ExitCode.PREEMPTED, stopped.stderr[-4000:]
    store = CheckpointStore(str(run_dir / "checkpoints"))
    (source,) = store.complete()
    step = int(source.rsplit("-", 1)[1])
    assert 2 < step <= 5, source  # no save was scheduled before step 100: this one is the preemption's
    assert store.manifest(source)["reason"] == "preemption" and (run_dir / "checkpoints" / source / STATE).is_dir()
    # Resumed with a save every step and only 2 kept: every save after the first rotates, never the source away.
    resumed, _ = fit(tmp_path, demo_data, "zero3", "pre", "--checkpoint.every_n_steps", "1",
                     "--checkpoint.keep_last_n", "2", "--checkpoint.keep_best_k", "0")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / source}" in resumed.stdout + resumed.stderr
    assert store.complete() == [checkpoint_name(END), checkpoint_name(END - 1), source]
    assert_equal(straight, weights(run_dir), "after the preemption")


def test_a_deepspeed_json_that_disagrees_with_the_run_is_refused_before_any_process_starts(tmp_path, demo_data):
    bad = tmp_path / "zero2.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 1}))
    out, _ = fit(tmp_path, demo_data, "zero2", "bad", "--trainer.strategy.init_args.config", str(bad))
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    assert "train_micro_batch_size_per_gpu = 4 but the run says 8 (data.batch_size_per_device)" in out.stderr
    assert "gradient_accumulation_steps = 1: remove it from the JSON" in out.stderr
    assert "Traceback" not in out.stderr and "Initializing distributed" not in out.stdout + out.stderr


def test_a_schedule_free_optimizer_is_refused_before_any_process_starts(tmp_path, demo_data):
    pytest.importorskip("schedulefree")
    out, _ = fit(tmp_path, demo_data, "zero2", "sf", "--model.optimizer", "schedulefree.AdamWScheduleFree")
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    assert "model.optimizer AdamWScheduleFree is schedule-free, and under DeepSpeed its eval() would move" in out.stderr
    assert "Traceback" not in out.stderr and "Initializing distributed" not in out.stdout + out.stderr


def test_bitsandbytes_8bit_adamw_steps_zeros_flat_partitions_with_8bit_states(tmp_path, demo_data):
    # ZeRO asserts on any optimizer outside its own list unless its JSON allows it: the presets' JSON does not say,
    # and lit-dist's strategy allows it.
    pytest.importorskip("bitsandbytes")
    out, run_dir = fit(tmp_path, demo_data, "zero2", "8bit", "--model.optimizer", "bitsandbytes.optim.AdamW8bit",
                       "--trainer.max_steps", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    saved = torch.load(next((run_dir / "checkpoints").glob("step-*/state.ckpt/checkpoint/*rank_0*optim_states.pt")),
                       weights_only=False)
    states = saved["optimizer_state_dict"]["base_optimizer_state"]["state"].values()
    quantized = [s["__bnb_optimizer_quant_state__"] for s in states if "__bnb_optimizer_quant_state__" in s]
    assert quantized and all(q["state1"].dtype == torch.uint8 for q in quantized), "ZeRO's partition is not 8-bit"


_FAILING_CXX = """#!/bin/sh
for arg in "$@"; do  # compiling fails as a broken toolchain does; --version and the ABI check pass
  if [ "$arg" = "-c" ]; then echo "planted.cpp:1:1: error: the planted compiler refuses to build" >&2; exit 1; fi
done
exec c++ "$@"
"""


def test_a_cpu_operator_that_does_not_compile_is_one_line_before_any_process_starts(tmp_path, demo_data):
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(_FAILING_CXX)
    cxx.chmod(0o755)
    out, _ = fit(tmp_path, demo_data, "zero2", "no-compiler", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops"),
                                                                    "CXX": str(cxx)})
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    assert "lit-dist: building DeepSpeed's CPU operators deepspeed_shm_comm for this machine, once" in out.stdout
    assert out.stderr.count("building DeepSpeed's CPU operator deepspeed_shm_comm failed: planted.cpp:1:1: error: "
                            "the planted compiler refuses to build. ") == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Initializing distributed" not in out.stdout + out.stderr


def test_the_lock_a_killed_operator_build_left_is_one_line_not_a_wait_forever(tmp_path, demo_data):
    # What a build interrupted by Ctrl-C or a job's time limit leaves: its lock, and no operator. torch waits on it.
    lock = tmp_path / "ops" / "deepspeed_shm_comm" / "lock"  # where torch builds it under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(parents=True)
    lock.touch()
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))
    out, _ = fit(tmp_path, demo_data, "zero2", "locked", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")})
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(lines) == 1 and f"locked for 60 minutes by {lock}" in lines[0] and "delete that file" in lines[0]
    assert "Traceback" not in out.stderr and "Initializing distributed" not in out.stdout + out.stderr


def test_a_resume_on_another_number_of_processes_is_one_line_not_deepspeeds_traceback(tmp_path, demo_data,
                                                                                       uninterrupted):
    shutil.copytree(uninterrupted("zero2")[1] / "checkpoints", tmp_path / "quickstart" / "moved" / "checkpoints")
    out, run_dir = fit(tmp_path, demo_data, "zero2", "moved", "--trainer.devices", "1")
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    assert (f"the checkpoint {run_dir / 'checkpoints' / checkpoint_name(END)} was saved by DeepSpeed on 2 processes "
            "and this run has 1" in out.stderr) and "Traceback" not in out.stderr


def test_bf16_weights_get_bf16_images_in_training_and_validation(tmp_path, demo_data):
    # DeepSpeed keeps bf16 weights under bf16-mixed; the images become float only after the transfer to the device,
    # after Lightning's precision plugin cast the batch: they must still reach the model in bf16 (GPU tier found it).
    # GroupNorm: CPU batch norm refuses bf16 inputs beside the float32 running statistics (CUDA's takes them).
    out, run_dir = fit(tmp_path, demo_data, "zero2", "bf16", "--trainer.precision", "bf16-mixed",
                       "--model.net.init_args.norm", "group")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "val/acc" in out.stdout + out.stderr
    assert {v.dtype for v in weights(run_dir).values()} <= {torch.float32, torch.int64}, "exported in float32"


def test_a_save_that_fails_on_one_rank_leaves_no_checkpoint_that_passes_for_complete(tmp_path, demo_data):
    # Rank 1's part of the save fails after the strategy's own save went through on both ranks: rank 0 alone
    # saw nothing wrong, and must not finish the checkpoint without rank 1's part (a marker listing no files).
    out, run_dir = fit(tmp_path, demo_data, "zero1", "failing",
                       "--trainer.callbacks+=tests.helpers.recorder.FailSaveOnRank")
    assert out.returncode == 1, out.stderr[-4000:]
    assert "injected: rank 1 could not write its part" in out.stderr and "Traceback" not in out.stderr, out.stderr[-4000:]
    checkpoints = run_dir / "checkpoints"
    assert not list(checkpoints.glob(f"*/{MARKER}")), "a checkpoint without rank 1's part passes for complete"
    assert not list(checkpoints.glob("step-*")), "the failed save's folder is removed"


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_a_resume_turns_the_weight_average_on_and_off(preset, tmp_path, demo_data):
    # DeepSpeed loads the module itself, strictly: a missing or unexpected average was its RuntimeError's traceback.
    def resume(max_steps, *extra):
        args = quickstart_args(tmp_path, demo_data, CONFIGS / f"deepspeed_{preset}.yaml", trainer__devices=2,
                               trainer__accelerator="cpu", data__batch_size_per_device=8, data__num_workers=0,
                               trainer__max_steps=max_steps, trainer__limit_val_batches=0,
                               trainer__enable_progress_bar=False, checkpoint__every_n_steps=4,
                               checkpoint__every_n_epochs=None, export__filename=None, run__run_id="r")
        return lit_dist("fit", *args, *extra, timeout=300)

    checkpoints = tmp_path / "quickstart" / "r" / "checkpoints"
    assert resume(4).returncode == 0
    out = resume(8, "--model.ema.start_step", "100")  # turned on here; no update before step 100
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "has no weight average (model.ema): it starts from its weights" in out.stderr
    saved, now = (load_checkpoint_state(str(checkpoints / checkpoint_name(s))) for s in (4, 8))
    averaged = [k for k in now if k.startswith("ema.average.")]
    assert averaged and all(torch.equal(now[k], saved["net." + k.removeprefix("ema.average.")]) for k in averaged), \
        "the average starts from the weights the run resumed with"
    out = resume(12)  # turned off again: the saved average is left behind
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not any(k.startswith("ema.") for k in load_checkpoint_state(str(checkpoints / checkpoint_name(12))))
