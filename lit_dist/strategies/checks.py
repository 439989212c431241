"""The checks of a run's strategy made before any process group exists, and the defaults it fills in: a wrong
strategy fails in seconds with exit code 2, never as a hang after processes started."""

import os

import torch

from lit_dist.errors import ConfigError
from lit_dist.strategies.deepspeed import INSTALL_DEEPSPEED, deepspeed_installed


def strategy_name(strategy) -> str:
    """The strategy as the user named it: a string, a class_path namespace's path or an instance's class."""
    if strategy is None:
        return "auto"
    if isinstance(strategy, str):
        return strategy
    return getattr(strategy, "class_path", None) or f"{type(strategy).__module__}.{type(strategy).__name__}"


def check_strategy(trainer_config, cuda_available: bool | None = None) -> list[str]:
    """Problems with the strategy that would only surface after processes started (or as a hang)."""
    name = strategy_name(trainer_config.strategy)
    key = name.lower()
    accelerator = str(trainer_config.accelerator).lower()
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    problems = []
    on_cpu = accelerator == "cpu" or (accelerator in ("auto", "none") and not cuda)
    if "deepspeed" in key:
        if on_cpu and key != "lit_dist.strategies.deepspeed.deepspeedstrategy":
            problems.append(f"trainer.strategy = {name!r} is Lightning's, which needs CUDA GPUs, and this run is on "
                            f"CPU (accelerator {accelerator!r}). Use lit_dist.strategies.deepspeed.DeepSpeedStrategy (every "
                            "configs/deepspeed_*.yaml preset does), which also runs on CPU.")
        if not deepspeed_installed():
            problems.append(f"trainer.strategy = {name!r} but DeepSpeed is not installed. {INSTALL_DEEPSPEED}")
    fsdp1 = key == "fsdp" or key.endswith(("strategies.fsdpstrategy", "fsdp.fsdpstrategy"))
    if fsdp1 and on_cpu:
        problems.append(f"trainer.strategy = {name!r} (FSDP1) needs CUDA GPUs and this machine has none. On CPU use "
                        "lit_dist.strategies.fsdp.FSDP2Strategy (configs/fsdp2.yaml), which shards over gloo.")
    return problems


def _init_args(strategy) -> dict:
    args = getattr(strategy, "init_args", None)
    return dict(vars(args)) if args is not None and not isinstance(args, dict) else dict(args or {})


def check_deepspeed(config, world_size: int) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a DeepSpeed run: its JSON vs the Trainer's values, offload vs optimizer, ZeRO-3."""
    import json

    if "deepspeed" not in strategy_name(config.trainer.strategy).lower():
        return [], []
    args = _init_args(config.trainer.strategy)
    ds = args.get("config")
    if isinstance(ds, str):
        try:
            with open(ds) as f:
                ds = json.load(f)
        except (OSError, ValueError) as exc:
            return [f"trainer.strategy.init_args.config = {ds!r}: cannot read it as JSON ({exc}); a relative "
                    f"path is taken from the working directory, {os.getcwd()}"], []
    ds = ds or {}
    zero = ds.get("zero_optimization", {})
    stage = zero.get("stage", args.get("stage", 2))
    problems, warnings = [], []
    per_device = getattr(getattr(config.data, "init_args", config.data), "batch_size_per_device", None)
    accumulate = int(config.trainer.accumulate_grad_batches or 1)
    ours = {"train_micro_batch_size_per_gpu": per_device, "gradient_accumulation_steps": accumulate,
            "gradient_clipping": config.trainer.gradient_clip_val}
    if "gradient_accumulation_steps" in ds:  # Lightning refuses it in the JSON, whatever its value
        problems.append(f"DeepSpeed config gradient_accumulation_steps = {ds['gradient_accumulation_steps']}: remove it "
                        "from the JSON; it comes from trainer.accumulate_grad_batches.")
    for key, value in ours.items():
        if key != "gradient_accumulation_steps" and key in ds and value is not None and ds[key] != value:
            problems.append(f"DeepSpeed config {key} = {ds[key]} but the run says {value} "
                            f"({'data.batch_size_per_device' if 'micro' in key else 'trainer.' + ('accumulate_grad_batches' if 'accum' in key else 'gradient_clip_val')}). "
                            "Remove it from the JSON (lit-dist fills it in) or make both the same.")
    if "train_batch_size" in ds and per_device:
        expected = per_device * world_size * accumulate
        if ds["train_batch_size"] != expected:
            problems.append(f"DeepSpeed config train_batch_size = {ds['train_batch_size']}, but data.batch_size_per_device "
                            f"x world size x trainer.accumulate_grad_batches = {per_device} x {world_size} x {accumulate} = "
                            f"{expected}. Remove train_batch_size from the JSON or make it {expected}.")
    offload = args.get("offload_optimizer") or zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
    optimizer = getattr(getattr(config.model, "init_args", config.model), "optimizer", None)
    optimizer_path = getattr(optimizer, "class_path", "") or ""
    if offload and "deepspeed" not in optimizer_path.lower():
        problems.append(f"optimizer offload needs DeepSpeed's CPU optimizer, but model.optimizer is {optimizer_path!r}. "
                        "Set model.optimizer.class_path: deepspeed.ops.adam.DeepSpeedCPUAdam.")
    if stage == 3:
        warnings.append("ZeRO-3: parameters are partitioned, so validation runs sharded and checkpoints are folders of "
                        "shards; lit-dist writes a consolidated model.pt at the end (lit-dist export converts any checkpoint).")
    return problems, warnings


def check_optimizer(config) -> list[str]:
    """Optimizers the run's strategy cannot step: a schedule-free one under DeepSpeed, bitsandbytes' under FSDP2."""
    import importlib

    from lit_dist.model.optimizers import schedule_free_class, under_deepspeed

    optimizer = getattr(getattr(config.model, "init_args", config.model), "optimizer", None)
    class_path = getattr(optimizer, "class_path", "") or ""
    strategy = strategy_name(config.trainer.strategy).lower()
    module, _, name = class_path.rpartition(".")
    problems = []
    if "deepspeed" in strategy:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            cls = None  # the run says so where it builds it
        if cls is not None and schedule_free_class(cls):
            problems.append(under_deepspeed(name))
    if strategy.endswith("fsdp2strategy") and module.split(".")[0] == "bitsandbytes":
        problems.append(f"model.optimizer {name} (bitsandbytes) steps plain tensors, and FSDP2's parameters are "
                        "DTensors (its kernels stop on them): use trainer.strategy ddp, or a DeepSpeed preset "
                        "(configs/deepspeed_zero2.yaml: ZeRO steps its own flat tensors, 8-bit states included)")
    return problems


def default_precision(trainer_config, cuda_available: bool | None = None) -> str:
    """bf16-mixed on GPUs that support it (unless the accelerator is forced to CPU), else 32-true."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    on_gpu = str(trainer_config.accelerator).lower() in ("auto", "gpu", "cuda") and cuda
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


def prepare_strategy(config) -> None:
    """Fill strategy-dependent defaults into a parsed run config and refuse what cannot work.

    Runs before any class is built, so a wrong strategy fails in seconds with exit code 2,
    never as a hang after processes started.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    from lit_dist.runtime.launch import world_size

    if config.trainer.precision is None:
        config.trainer.precision = default_precision(config.trainer)
    problems = check_strategy(config.trainer)
    deepspeed_problems, warnings = check_deepspeed(config, world_size(config.trainer)[0])
    for warning in warnings:
        rank_zero_warn(f"lit-dist: {warning}")
    ConfigError.collect(problems + deepspeed_problems + check_optimizer(config))
    init_args = getattr(config.trainer.strategy, "init_args", None)
    per_device = getattr(getattr(config.data, "init_args", config.data), "batch_size_per_device", None)
    deepspeed = "deepspeed" in strategy_name(config.trainer.strategy).lower()
    if deepspeed:
        _build_deepspeed_ops(config)
    if deepspeed and init_args is not None and getattr(init_args, "logging_batch_size_per_gpu", "auto") == "auto" \
            and per_device:
        # DeepSpeed's micro batch: Lightning would guess it from the loader's batch_size, which
        # lit-dist's loaders leave unset (the dataset returns whole batches).
        init_args.logging_batch_size_per_gpu = per_device


def _build_deepspeed_ops(config) -> None:
    """DeepSpeed's CPU operators a run on CPU processes will load, built before any process group (by every process:
    the first builds, the others wait for its lock and load it; the launching process says so)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lit_dist.strategies.deepspeed import build_cpu_ops

    accelerator = str(config.trainer.accelerator).lower()
    if not (accelerator == "cpu" or (accelerator in ("auto", "none") and not torch.cuda.is_available())):
        return  # on GPUs DeepSpeed's own JIT build, for the GPU, stays as it is
    names = ["deepspeed_shm_comm"]
    optimizer = getattr(getattr(config.model, "init_args", config.model), "optimizer", None)
    if "cpuadam" in str(getattr(optimizer, "class_path", "") or "").lower():
        names.append("cpu_adam")
    build_cpu_ops(names, say=rank_zero_only.rank == 0)
