from types import SimpleNamespace

import pytest

from lit_dist.errors import ConfigError
from lit_dist.model.nets import SimpleCNN
from lit_dist.strategies.checks import check_strategy
from lit_dist.strategies.fsdp import find_blocks, import_classes


def test_block_classes_that_do_not_import_are_all_named():
    with pytest.raises(ConfigError) as err:
        import_classes(["lit_dist.model.nets.NoSuchBlock", "nope.Block", "lit_dist.model.nets.ConvStage"], "block_classes")
    assert "NoSuchBlock" in str(err.value) and "nope.Block" in str(err.value) and "2 problems" in str(err.value)


def test_block_classes_the_model_lacks_get_suggestions():
    from torch import nn

    class Block(nn.Module):
        pass

    with pytest.raises(ConfigError, match="contains none of them"):
        find_blocks(SimpleCNN(), [Block], "trainer.strategy.init_args.block_classes")
    assert len(find_blocks(SimpleCNN(channels=(8, 8, 8)), import_classes(["lit_dist.model.nets.ConvStage"], "x"), "x")) == 3


@pytest.mark.parametrize("strategy,needle,alternative", [
    ("deepspeed", "needs CUDA", "lit_dist.strategies.deepspeed.DeepSpeedStrategy"),  # Lightning's own, by its registered name
    ("fsdp", "FSDP1", "FSDP2"),
    (SimpleNamespace(class_path="lit_dist.strategies.fsdp.FSDPStrategy"), "FSDP1", "FSDP2")])
def test_gpu_only_strategies_are_refused_on_cpu_with_the_alternative(strategy, needle, alternative):
    problems = check_strategy(SimpleNamespace(strategy=strategy, accelerator="auto"), cuda_available=False)
    assert problems and needle in problems[0] and alternative in problems[0], problems
    assert not check_strategy(SimpleNamespace(strategy="ddp", accelerator="auto"), cuda_available=False)
    assert not check_strategy(SimpleNamespace(strategy="fsdp", accelerator="gpu"), cuda_available=True)


def test_fsdp1_and_deepspeed_presets_construct_on_cpu():
    import json

    import yaml

    from lit_dist.model.nets import ConvStage
    from lit_dist.strategies.deepspeed import DeepSpeedStrategy
    from lit_dist.strategies.fsdp import FSDPStrategy
    from tests.conftest import CONFIGS

    fsdp_args = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())["trainer"]["strategy"]["init_args"]
    fsdp = FSDPStrategy(**fsdp_args)
    assert fsdp.kwargs["auto_wrap_policy"]._module_classes == {ConvStage} and fsdp.sharding_strategy.name == "FULL_SHARD"
    for name in ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3", "deepspeed_zero3_offload"):
        strategy_config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["trainer"]["strategy"]
        assert strategy_config["class_path"] == "lit_dist.strategies.deepspeed.DeepSpeedStrategy", name
        path = strategy_config["init_args"]["config"]
        expected = json.loads((CONFIGS.parent / path).read_text())["zero_optimization"]["stage"]
        strategy = DeepSpeedStrategy(config=str(CONFIGS.parent / path))
        assert strategy.config["zero_optimization"]["stage"] == expected


@pytest.mark.process
@pytest.mark.parametrize("preset", ["deepspeed_zero2_offload.yaml", "deepspeed_zero3_offload.yaml"])
def test_offload_presets_without_deepspeed_name_the_install_command(preset, tmp_path):
    from lit_dist.errors import ExitCode
    from tests.conftest import CONFIGS, lit_dist, quickstart_args

    # A machine without DeepSpeed: the import fails as it would there.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n")
    out = lit_dist("fit", *quickstart_args(tmp_path, None, CONFIGS / preset), env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(error) == 1 and "Type" not in error[0], out.stderr[-2000:]
    assert "model.optimizer" in error[0] and "DeepSpeed is not installed" in error[0]
    assert "pip install --no-build-isolation deepspeed" in error[0]
