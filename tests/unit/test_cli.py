"""The command line as a user meets it: configs, overrides, help, bad input, run directories."""

import inspect
import os
import re

import pytest
import torch
import yaml

from lit_dist.cli.app import LitDistCLI
from lit_dist.cli.commands import COMMANDS
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError, ExitCode
from lit_dist.model.module import LitModel
from lit_dist.runtime.run_dir import RunConfig, check_writable, resolve_run_id
from tests.conftest import CONFIGS, lit_dist, quickstart_args
from tests.helpers.small_fs import tmpfs

# Standalone, each naming a pipeline folder of its family (the name's first part): full fine-tunes and adapters.
FINETUNE = sorted(p for pattern in ("*_finetune.yaml", "*_lora.yaml", "*_lokr.yaml") for p in CONFIGS.glob(pattern))
SHIPPED = sorted(set(CONFIGS.glob("*.yaml")) - set(FINETUNE))


GPU_ONLY = {"fsdp.yaml"}  # Lightning refuses FSDP1 on CPU; FSDP2 and every DeepSpeed preset run there


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_builds_model_data_and_trainer(config, tmp_path, demo_data):
    # Overlays (strategies, trainer options) are layered on the quickstart, the way their headers say.
    args = quickstart_args(tmp_path, demo_data, *([config] if config.name != "quickstart.yaml" else []))
    if config.name in GPU_ONLY and not torch.cuda.is_available():
        # Refused before any process starts, with the CPU alternatives named.
        with pytest.raises(ConfigError, match="needs CUDA GPUs.*FSDP2Strategy"):
            LitDistCLI(args=args, run=False)
        return
    cli = LitDistCLI(args=args, run=False)
    assert isinstance(cli.model, LitModel)
    assert isinstance(cli.datamodule, BucketDataModule)
    assert cli.trainer.default_root_dir.startswith(str(tmp_path))


@pytest.mark.parametrize("config", FINETUNE, ids=lambda p: p.name)
def test_every_finetune_config_builds_from_a_folder_of_its_family(config, tmp_path, demo_data):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from lit_dist.model.nets.pipeline import PipelineDenoiser
    from tests.helpers.pipelines import save_pipeline

    family = config.name.split("_")[0]
    folder = save_pipeline(family, tmp_path / family)
    cli = LitDistCLI(args=["--config", str(config), "--pipeline.path", str(folder), "--data.metadata", str(demo_data),
                           "--data.cache.dir", str(tmp_path / "cache"), "--run.root_dir", str(tmp_path)], run=False)
    assert isinstance(cli.model.net, PipelineDenoiser) and cli.model.net.family == family
    assert type(cli.model.objective).__name__ == ("FlowMatching" if family in ("sd3", "flux") else "Diffusion")
    assert cli.datamodule.cache.caption_encoder["init_args"]["pipeline"] == str(folder)
    assert cli.trainer.default_root_dir.startswith(str(tmp_path))
    kind = config.stem.split("_")[1]
    if kind in ("lora", "lokr"):  # an adapter config: the adapter in the denoiser, the rest frozen
        pytest.importorskip("peft")
        assert cli.model.adapter.kind == kind
        assert any(p.requires_grad for p in cli.model.net.parameters())
        assert not all(p.requires_grad for p in cli.model.net.parameters())


def test_a_strategy_class_named_on_the_command_line_is_that_class(tmp_path, demo_data):
    """Lightning's trainer.strategy takes a string as a registered name: a dotted class path is made a class_path
    (both flag forms), a name stays a name."""
    from lit_dist.cli.app import strategy_classes
    from lit_dist.strategies.fsdp import FSDP2Strategy

    for form in (["--trainer.strategy", "lit_dist.strategies.fsdp.FSDP2Strategy"],
                 ["--trainer.strategy=lit_dist.strategies.fsdp.FSDP2Strategy"]):
        cli = LitDistCLI(args=[*quickstart_args(tmp_path, demo_data), *form], run=False)
        assert isinstance(cli.trainer.strategy, FSDP2Strategy), form
    assert strategy_classes(["--trainer.strategy", "ddp", "--x", "a.b"]) == ["--trainer.strategy", "ddp", "--x", "a.b"]


def test_deepspeed_json_that_disagrees_with_the_run_is_refused(tmp_path):
    import json
    from types import SimpleNamespace

    from lit_dist.strategies.checks import check_deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 100, "gradient_accumulation_steps": 4,
                                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    config = SimpleNamespace(
        trainer=SimpleNamespace(strategy=SimpleNamespace(class_path="lightning.pytorch.strategies.DeepSpeedStrategy",
                                                         init_args=SimpleNamespace(config=str(path))),
                                accumulate_grad_batches=2, gradient_clip_val=None),
        data=SimpleNamespace(init_args=SimpleNamespace(batch_size_per_device=8)),
        model=SimpleNamespace(init_args=SimpleNamespace(optimizer=SimpleNamespace(class_path="torch.optim.AdamW"))),
    )
    problems, warnings = check_deepspeed(config, world_size=4)
    text = " ".join(problems)
    assert "gradient_accumulation_steps = 4: remove it from the JSON" in text  # Lightning refuses it, whatever value
    assert "train_batch_size = 100" in text and "8 x 4 x 2 = 64" in text
    assert "DeepSpeedCPUAdam" in text
    assert warnings and "ZeRO-3" in warnings[0]


def test_lightning_s_own_deepspeed_strategy_on_cpu_is_refused_naming_lit_dist_s():
    from types import SimpleNamespace

    from lit_dist.strategies.checks import check_strategy

    def trainer(path):
        return SimpleNamespace(strategy=SimpleNamespace(class_path=path), accelerator="cpu")

    problems = check_strategy(trainer("lightning.pytorch.strategies.DeepSpeedStrategy"), cuda_available=False)
    assert len(problems) == 1 and "Use lit_dist.strategies.deepspeed.DeepSpeedStrategy" in problems[0], problems
    assert check_strategy(trainer("lit_dist.strategies.deepspeed.DeepSpeedStrategy"), cuda_available=False) == []


@pytest.mark.process
def test_several_configs_and_dotted_overrides_apply_in_order(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  warmup_steps: 7\ndata:\n  batch_size_per_device: 5\n")
    out = lit_dist("fit", *quickstart_args(None, None, extra, data__batch_size_per_device=6), "--print_config")
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert config["model"]["init_args"]["warmup_steps"] == 7
    assert config["data"]["init_args"]["batch_size_per_device"] == 6
    assert config["model"]["init_args"]["net"]["class_path"] == "lit_dist.model.nets.SimpleCNN"


@pytest.mark.process
@pytest.mark.parametrize("flag", ["--help", "-h", None])
def test_top_level_help_lists_every_command_with_its_line(flag):
    out = lit_dist(*([flag] if flag else []))
    assert out.returncode == (0 if flag else ExitCode.CONFIG_ERROR), out.stderr[-2000:]
    text = out.stdout if flag else out.stderr
    from lit_dist.cli.commands import NAMES

    for name in NAMES:
        line = re.search(rf"^  {name}\s+(\S.*)$", text, re.M)
        assert line and len(line.group(1)) > 20, f"{name} missing from lit-dist {flag or ''}:\n{text}"
    assert "lit-dist fit --help" in text


@pytest.mark.process
@pytest.mark.parametrize("name", [name for name, command in COMMANDS.items() if command.run_config])
def test_each_run_config_command_shows_its_help_without_its_required_arguments(name):
    out = lit_dist(name, "--help")  # sample's checkpoint is required: --help alone still shows it
    assert out.returncode == 0 and out.stdout.startswith(f"usage: lit-dist {name}"), out.stderr[-2000:]
    own = list(inspect.signature(COMMANDS[name].function()).parameters)[1:]
    assert all(f"--{flag}" in out.stdout for flag in own), (own, out.stdout[:2000])


@pytest.mark.process
def test_help_lists_every_knob_with_a_description():
    out = lit_dist("fit", "--help")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    from lit_dist.callbacks.preflight import Preflight
    from lit_dist.callbacks.stragglers import StragglerDetector
    from lit_dist.callbacks.watchdog import HangWatchdog

    for prefix, cls in (("model", LitModel), ("data", BucketDataModule), ("run", RunConfig), ("watchdog", HangWatchdog),
                        ("straggler", StragglerDetector), ("preflight", Preflight)):
        for name in inspect.signature(cls.__init__).parameters:
            if name == "self":
                continue
            match = re.search(rf"^  --{prefix}\.{name}\b[^\n]*\n((?:\s{{20,}}.*\n)+)", text, re.M)
            assert match, f"--{prefix}.{name} missing from --help"
            assert not match.group(1).strip().startswith("(type"), f"--{prefix}.{name} has no description"


@pytest.mark.process
@pytest.mark.parametrize(
    "args,code,needles",
    [
        (["--model.lr_scalin", "linear"], ExitCode.CONFIG_ERROR, ["model.lr_scalin", "not accepted"]),
        (["--trainer.max_epochs", "many"], ExitCode.CONFIG_ERROR, ["trainer.max_epochs", "int", "many"]),
        (["--model.net.class_path", "no_such_pkg.Net"], ExitCode.CONFIG_ERROR, ["model.net", "no_such_pkg"]),
        (["--model.base_batch_size", "0"], ExitCode.CONFIG_ERROR, ["model.base_batch_size = 0", ">= 1"]),
        (["--data.metadata", "/nowhere/meta.parquet", "--data.create_demo_if_missing", "false"], ExitCode.DATA_ERROR,
         ["data.metadata", "/nowhere/meta.parquet", "no parquet file"]),
        (["--trainer.default_root_dir", "/elsewhere"], ExitCode.CONFIG_ERROR,
         ["trainer.default_root_dir = '/elsewhere'", "run.root_dir"]),
    ],
    ids=["unknown-key", "wrong-type", "bad-class-path", "bad-value", "missing-metadata", "default-root-dir"],
)
def test_bad_input_gets_one_clear_message_and_a_documented_exit_code(args, code, needles, tmp_path):
    out = lit_dist("fit", *quickstart_args(tmp_path, trainer__max_epochs=1), *args)
    assert out.returncode == code, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "usage:" not in out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(error) == 1, out.stderr[-2000:]
    for needle in needles:
        assert needle in error[0]


@pytest.mark.process
def test_a_missing_table_is_a_data_error_not_a_demo_even_with_create_demo_if_missing(tmp_path):
    missing = tmp_path / "some" / "where" / "meta.parquet"
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", missing), cwd=tmp_path)
    assert out.returncode == ExitCode.DATA_ERROR, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(error) == 1 and f"data.metadata = '{missing}'" in error[0] and "data/shapes/metadata.parquet" in error[0]
    assert not (tmp_path / "some").exists() and not (tmp_path / "data").exists()


@pytest.mark.process
def test_fit_prints_nothing_meaningless(tmp_path, demo_data):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(demo_data)
    names = table.column("filename").to_pylist()
    names[0] = "file::/etc/passwd"  # one bad row, for the skipped-rows warning
    metadata = tmp_path / "meta.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("filename"), "filename", pa.array(names)), metadata)
    out = lit_dist("fit", *quickstart_args(tmp_path, metadata, data__root=demo_data.parent, trainer__max_steps=2,
                                           trainer__limit_val_batches=1, data__num_workers=0, data__batch_size_per_device=8,
                                           trainer__enable_progress_bar=False, trainer__log_every_n_steps=100))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    skipped = [line for line in text.splitlines() if "skipped 1 bad rows" in line]
    assert skipped and all(line.startswith("lit-dist: skipped") for line in skipped), text[-3000:]
    assert "rank_zero_warn(" not in text and "UserWarning" not in text, "a lit-dist warning printed its source line"
    assert "Total params" in text and "Flops" not in text and "FLOPs" not in text, "FLOPs are never measured: all 0"
    assert "smaller than the logging interval" not in text, "an epoch shorter than the log interval loses no log"
    if shutil.which("srun"):  # Slurm's client tools are installed, but this is no Slurm job
        assert "`srun` command is available" not in text


def test_run_id_is_shared_by_child_processes_and_follows_slurm():
    assert resolve_run_id("mine", {"SLURM_JOB_ID": "5"}) == "mine"
    assert resolve_run_id(None, {"LIT_DIST_RUN_ID": "abc", "SLURM_JOB_ID": "5"}) == "abc"
    assert resolve_run_id(None, {"SLURM_JOB_ID": "77"}) == "slurm-77"
    assert resolve_run_id(None, {"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm-70_3"
    assert re.fullmatch(r"\d{8}-\d{6}", resolve_run_id(None, {}))
    # torchrun without --rdzv-id, the DeepSpeed launcher: every process of the launcher reads the same id.
    launched = resolve_run_id(None, {"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "none"})
    assert re.fullmatch(rf"torchrun-\d{{8}}-\d{{6}}-{os.getppid()}", launched)
    assert resolve_run_id(None, {"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none"}) == launched


def test_a_run_directory_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    # Each rank writes its own files there while it sets up (its hang file): rank 1 failed there with a traceback
    # and rank 0 said only that rank 1 had ended with exit 1.
    with tmpfs(tmp_path / "ro", 64, read_only=True) as ro:
        with pytest.raises(ConfigError) as refused:
            check_writable(str(ro / "exp" / "r1"))
        assert str(refused.value) == (f"run.root_dir: the run directory {ro / 'exp' / 'r1'} cannot be made or written "
                                      f"here: {ro} is on a read-only filesystem. Set --run.root_dir to a folder this "
                                      "user can write (on several nodes, one they share)")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'file'} is not a folder"):
        check_writable(str(tmp_path / "file" / "exp" / "r1"))
    check_writable(str(tmp_path / "new" / "exp" / "r1"))  # made later, by whoever writes first
    assert not (tmp_path / "new").exists()


@pytest.mark.process
def test_fit_into_a_read_only_run_directory_on_two_processes_is_one_line_and_exit_2(tmp_path, demo_data):
    with tmpfs(tmp_path / "ro", 64, read_only=True) as ro:
        out = lit_dist("fit", *quickstart_args(ro, demo_data, trainer__devices=2, trainer__max_steps=2))
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1 and "is on a read-only filesystem" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.process
def test_a_rerun_into_the_same_run_directory_does_not_abort(tmp_path, demo_data):
    args = quickstart_args(tmp_path, demo_data, run__run_id="same", trainer__max_epochs=1, trainer__limit_train_batches=2,
                           trainer__limit_val_batches=1, data__num_workers=0, data__batch_size_per_device=8)
    for _ in range(2):
        out = lit_dist("fit", *args)
        assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "quickstart" / "same"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["run"]["run_id"] == "same"
    assert list((run / "checkpoints").glob("step-*/COMPLETE.json"))
    # The rerun of the finished run logged nothing: no second (empty) events file.
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    # The config saved for the run runs it again (it names the run's own directory).
    out = lit_dist("validate", "--config", str(run / "config.yaml"))
    assert out.returncode == 0 and "val/acc" in out.stdout, out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.process
def test_validate_test_and_predict_use_a_checkpoint(tmp_path, demo_data):
    common = quickstart_args(tmp_path, demo_data, data__num_workers=0, trainer__enable_progress_bar=False,
                             data__batch_size_per_device=8)
    out = lit_dist("fit", *common, "--run.run_id", "train", "--trainer.max_epochs", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = next((tmp_path / "quickstart" / "train" / "checkpoints").glob("step-*"))
    for sub, needle in (("validate", "val/acc"), ("test", "test/acc"), ("predict", "predictions written")):
        out = lit_dist(sub, *common, "--run.run_id", sub, "--ckpt_path", str(ckpt))
        assert out.returncode == 0, out.stderr[-3000:]
        assert needle in out.stdout
    # ckpt_path: auto (the default) finds the run's own newest checkpoint.
    out = lit_dist("validate", *common, "--run.run_id", "train")
    assert out.returncode == 0 and f"resuming from {ckpt}" in out.stdout + out.stderr, out.stderr[-3000:]
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "quickstart" / "predict" / "predictions-rank0.parquet")
    assert table.num_rows == 400 and sorted(table.column("row").to_pylist()) == list(range(400))


@pytest.mark.parametrize("stack", sorted((CONFIGS.parent / "callbacks").glob("*.yaml")), ids=lambda p: p.name)
def test_every_callback_stack_loads(stack, tmp_path, demo_data, monkeypatch):
    monkeypatch.setenv("DISCORD_WEBHOOK_URL", "http://127.0.0.1:9/discord")
    monkeypatch.setenv("ORCHESTRATOR_URL", "http://127.0.0.1:9/raw")
    cli = LitDistCLI(args=quickstart_args(tmp_path, demo_data, trainer__callbacks=stack), run=False)
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"GPUCircuitBreaker", "WebhookNotifier"} <= names
