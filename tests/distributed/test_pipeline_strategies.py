"""A pretrained pipeline's denoiser fine-tuned on two CPU processes under DDP, FSDP2 (its blocks sharded one by one)
and DeepSpeed ZeRO-3, with a weight average: a run stopped mid-way and resumed ends with the uninterrupted run's
weights and average, bitwise, and its checkpoint (sharded or partitioned) leaves as a diffusers folder. Four cases
train an adapter instead (model.adapter: a LoRA under FSDP2, whose blocks then hold frozen and trained parameters
together, a LoRA under ZeRO-2 and under ZeRO-3, and a LoKr under DDP), the first resumed after a rank is SIGKILLed
mid-run: their checkpoints hold the adapter, not the base, and the adapter leaves alone, as diffusers or peft load
it."""

import shutil

import pytest
import torch

from lit_dist.ckpt.export import load_checkpoint_state
from lit_dist.errors import ExitCode
from tests.conftest import CONFIGS, lit_dist

pytestmark = pytest.mark.distributed
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from tests.helpers.pipelines import save_pipeline  # noqa: E402

STOP, END = 3, 6
STRATEGIES = {
    "ddp": ["--trainer.strategy", "ddp"],
    # No block_classes: pipeline.path fills in the family's blocks.
    "fsdp2": ["--trainer.strategy", '{"class_path": "lit_dist.strategies.fsdp.FSDP2Strategy"}'],
    "zero2": ["--config", str(CONFIGS / "deepspeed_zero2.yaml")],
    "zero3": ["--config", str(CONFIGS / "deepspeed_zero3.yaml")],
}
# The grid at the end of each run, drawn under the run's strategy (ZeRO-3 gathers in the denoiser's forward): two
# images of two steps. The default (8 prompts x 4 images x 30 steps, with guidance) cost more than the training.
SAMPLES = ["--samples.num_prompts", "2", "--samples.per_prompt", "1", "--samples.steps", "2"]
KILL = ["--trainer.callbacks+=tests.helpers.recorder.KillRankAtStep", "--trainer.callbacks.step", str(STOP + 1)]
ADAPTERS = {"lora": ["--model.adapter.kind", "lora", "--model.adapter.rank", "4"],
            "lokr": ["--model.adapter.kind", "lokr", "--model.adapter.rank", "4"]}
# SDXL's U-Net of ~500 small tensors under ZeRO-3 gathers each in its own hook: 224 s for a LoRA case on CI's two
# cores against Flux's 63 s for two fits, so ZeRO-3's adapter case is Flux's.
CASES = [("sdxl", "ddp", None), ("sdxl", "fsdp2", "lora"), ("flux", "ddp", "lokr"), ("flux", "zero2", "lora"),
         ("flux", "zero3", "lora"), ("flux", "fsdp2", None), ("flux", "zero3", None)]
# The case whose resumed run follows a rank SIGKILLed mid-run (the others resume from a copy of the straight run's
# save, a fit fewer): FSDP2's blocks hold frozen and trained parameters together, and its sharded save of the adapter
# alone is lit-dist's own. Killed ZeRO runs resume in test_deepspeed.py; 3 fits of a ZeRO-3 case cost a minute.
KILLED = ("sdxl", "fsdp2", "lora")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path_factory.mktemp("shapes") / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=64, seed=2)
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (its pipeline folder, its cache folder), made by the first case of the family and shared by the
    others: the caches are built under the first case's strategy, and read under the others'."""
    root, out = tmp_path_factory.mktemp("pipelines"), {}

    def get(family: str):
        if family not in out:
            out[family] = save_pipeline(family, root / family), root / f"{family}-cache"
        return out[family]
    return get


def fit(tmp_path, folder, cache, shapes, strategy, run_id, *extra, code: int = 0):
    out = lit_dist("fit", "--pipeline.path", str(folder), *STRATEGIES[strategy], "--trainer.devices", "2",
                   "--data.metadata", str(shapes), "--data.resolution", "32", "--data.batch_size_per_device", "4",
                   "--data.num_workers", "0", "--data.allow_oversubscription", "true", "--data.cache.dir",
                   str(cache), "--run.root_dir", str(tmp_path), "--run.name", "ft", "--run.run_id", run_id,
                   "--trainer.max_steps", str(END), "--trainer.limit_val_batches", "1", "--trainer.val_check_interval",
                   "3", "--checkpoint.every_n_epochs", "null", "--checkpoint.every_n_steps", "3", "--model.ema.decay",
                   "0.9", "--samples.at_validation", "false", *SAMPLES, "--trainer.enable_progress_bar", "false", *extra,
                   timeout=400)
    assert out.returncode == code, out.stderr[-4000:]
    return tmp_path / "ft" / run_id, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("family,strategy,adapter", CASES)
def test_a_pipeline_resumes_bitwise_under_each_strategy_and_exports(family, strategy, adapter, shapes, made,
                                                                    tmp_path):
    from diffusers import DiffusionPipeline

    folder, cache = made(family)
    extra = ADAPTERS[adapter] if adapter else []
    straight, _ = fit(tmp_path, folder, cache, shapes, strategy, "straight", *extra)
    if (family, strategy, adapter) == KILLED:  # a rank SIGKILLed after step STOP + 1: resumed from its save at STOP
        fit(tmp_path, folder, cache, shapes, strategy, "resumed", *extra, *KILL, code=ExitCode.PROCESS_DIED)
    else:  # the straight run's save at step STOP, alone in a run of its own: what a run stopped there leaves
        shutil.copytree(straight / "checkpoints" / f"step-{STOP:09d}", tmp_path / "ft" / "resumed" / "checkpoints" /
                        f"step-{STOP:09d}")
    resumed, said = fit(tmp_path, folder, cache, shapes, strategy, "resumed", *extra)
    assert f"resuming from {tmp_path / 'ft' / 'resumed' / 'checkpoints' / f'step-{STOP:09d}'}" in said, said[-2000:]

    state, again = (load_checkpoint_state(str(run / "checkpoints")) for run in (straight, resumed))
    averaged = [k for k in state if k.startswith("ema.average.")]
    assert averaged and state.keys() == again.keys()
    for key in state:
        assert torch.equal(state[key], again[key]), f"{key} differs after the resume"

    out = lit_dist("export", str(straight / "checkpoints"), "--output", str(tmp_path / "exported"))
    assert out.returncode == 0, out.stderr[-3000:]
    denoiser = "unet" if family == "sdxl" else "transformer"
    if adapter:
        _check_adapter(state, averaged, folder, tmp_path / "exported", adapter, denoiser)
        if (family, strategy, adapter) == ("flux", "zero3", "lora"):
            _check_kohya(straight, tmp_path / "kohya", state)
        return
    loaded = getattr(DiffusionPipeline.from_pretrained(tmp_path / "exported"), denoiser).state_dict()
    trained = {k.removeprefix("net.model."): v for k, v in state.items() if k.startswith("net.model.")}
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[k], trained[k].float()) for k in trained)


def _check_adapter(state: dict, averaged: list, folder, exported, adapter: str, denoiser: str) -> None:
    """The checkpoint holds the adapter and the base's fingerprint, not the base; the average is the adapter's alone;
    the exported adapter holds the trained factors under the names diffusers (LoRA) or peft (LoKr) load."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    keys = ("lora_", "lokr_")
    assert averaged and all(any(k in name for k in keys) for name in averaged), averaged[:3]
    base = [k for k in state if k.startswith("net.") and not any(m in k for m in keys)]
    assert not base, f"the checkpoint holds the base: {base[:3]}"
    assert state["adapter_base"].dtype == torch.uint8 and state["adapter_base"].shape == (32,)
    trained = {k.removeprefix("net.model.").replace(".default", ""): v for k, v in state.items()
               if k.startswith("net.model.") and any(m in k for m in keys)}
    if adapter == "lora":
        written = {k.removeprefix(f"{denoiser}."): v for k, v in
                   load_file(exported / "pytorch_lora_weights.safetensors").items()}
        pipeline = DiffusionPipeline.from_pretrained(folder)
        pipeline.load_lora_weights(str(exported))
    else:
        written = load_file(exported / "adapter_model.safetensors")
    assert written.keys() == trained.keys() and all(torch.equal(written[k], trained[k].float()) for k in trained)


def _check_kohya(run, output, state: dict) -> None:
    """`lit-dist export --format kohya` of a Flux LoRA from a partitioned checkpoint: BFL's names, a block's q, k
    and v one layer of 3 x the rank, the single block's linear1 of 4 x (its MLP input's part zero: not adapted)."""
    from safetensors.torch import load_file

    out = lit_dist("export", str(run / "checkpoints"), "--output", str(output), "--format", "kohya")
    assert out.returncode == 0, out.stderr[-3000:]
    written = load_file(output / "kohya.safetensors")
    double = ("img_attn_qkv", "txt_attn_qkv", "img_attn_proj", "txt_attn_proj", "img_mlp_0", "img_mlp_2", "txt_mlp_0",
              "txt_mlp_2")
    assert {k.split(".")[0] for k in written} == {f"lora_unet_double_blocks_0_{n}" for n in double} | {
        "lora_unet_single_blocks_0_linear1"}
    trained = {k.removeprefix("net.model.").replace(".default", ""): v.float() for k, v in state.items()
               if k.startswith("net.model.") and "lora_" in k}
    down, up = (written[f"lora_unet_single_blocks_0_linear1.lora_{part}.weight"] for part in ("down", "up"))
    q = "single_transformer_blocks.0.attn.to_q"
    assert down.shape[0] == 16 and written["lora_unet_single_blocks_0_linear1.alpha"] == 16
    assert torch.equal(down[:4], trained[f"{q}.lora_A.weight"])
    assert torch.equal(up[: trained[f"{q}.lora_B.weight"].shape[0], :4], trained[f"{q}.lora_B.weight"])
    assert not up[3 * trained[f"{q}.lora_B.weight"].shape[0]:].any()
