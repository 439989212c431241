"""Strategy presets that take their settings from YAML, and the checks run before any process group.

    trainer:
      strategy:
        class_path: lit_dist.strategies.FSDP2Strategy
        init_args:
          block_classes: [my_project.nets.Block]

``FSDP2Strategy`` shards each configured block with ``fully_shard`` (FSDP2) over all
devices; it runs on CPU over gloo too, so sharded training is tested without a GPU.
``FSDPStrategy`` is Lightning's FSDP (FSDP1) with the wrap and activation-checkpointing
policies given as class paths. ``DeepSpeedStrategy`` is Lightning's, able to run on CPU too
(``configs/deepspeed_*.yaml``).
"""

import importlib
import importlib.util
import os
import re
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from torch import nn

from lit_dist.ckpt.match import differences, refuse
from lit_dist.ckpt.store import STATE
from lit_dist.errors import ConfigError


def import_classes(paths: list[str], field: str) -> list[type]:
    """Classes from import paths; one ConfigError naming every path that does not import."""
    classes, problems = [], []
    for path in paths:
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"{field}: {path!r} does not import ({exc}); give the full import path of a module class")
            continue
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            problems.append(f"{field}: {path!r} is not a torch.nn.Module class")
        classes.append(cls)
    ConfigError.collect(problems)
    return classes


def find_blocks(model: nn.Module, classes: list[type], field: str) -> list[nn.Module]:
    """The submodules of ``model`` that are instances of ``classes``; ConfigError if there are none."""
    blocks = [m for m in model.modules() if isinstance(m, tuple(classes)) and m is not model]
    if not blocks:
        counts: dict[str, int] = {}
        for m in model.modules():
            name = f"{type(m).__module__}.{type(m).__qualname__}"
            counts[name] = counts.get(name, 0) + 1
        repeated = [n for n, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c > 1 and not n.startswith("torch.")]
        hint = f" Repeated classes in this model: {', '.join(repeated[:5])}." if repeated else ""
        raise ConfigError(
            f"{field} = {[c.__qualname__ for c in classes]}: the model {type(model).__name__} contains none of them.{hint} "
            "Name the class of the model's repeated blocks (e.g. a transformer layer)."
        )
    return blocks


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2: every configured block, then the whole network, wrapped with ``fully_shard`` over all devices.

    Parameters, gradients and optimizer state are split across ranks; a block's parameters
    are gathered just for its forward and backward. ``LitModel.configure_model`` calls
    ``shard``; any LightningModule can call it from its own ``configure_model``.
    """

    def __init__(
        self,
        block_classes: list[str] | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        bf16_gather: bool = True,
        **kwargs,
    ):
        """Configure FSDP2.

        Args:
            block_classes: Import paths of the block classes to shard one by one (e.g. a transformer layer);
                empty: the network is sharded as one unit.
            reshard_after_forward: Free gathered parameters after each block's forward (less memory, one more all-gather).
            activation_checkpointing: Recompute each block's activations in the backward pass instead of storing them.
            save_distributed_checkpoint: Each rank saves its shard (a folder); false gathers one file on rank 0.
            bf16_gather: Under trainer.precision bf16-mixed, gather parameters in bf16 and reduce gradients in
                float32 (half the gathered memory and traffic); the shards and optimizer stay float32.
        """
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.block_classes = import_classes(block_classes or [], "trainer.strategy.init_args.block_classes")
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.bf16_gather = bf16_gather

    def setup_environment(self) -> None:
        # Pure data parallelism over every device of every node: one data-parallel dimension.
        from lit_dist.compat import set_data_parallel

        set_data_parallel(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def shard(self, net: nn.Module) -> None:
        """Apply activation checkpointing (if asked) and ``fully_shard`` to the blocks, then to ``net``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if getattr(net, "_lit_dist_sharded", False):
            return
        mesh = self.device_mesh["data_parallel"]
        # Autocast alone (Lightning's bf16-mixed) would still gather and reduce float32 parameters.
        bf16 = self.bf16_gather and getattr(self.precision_plugin, "precision", None) == "bf16-mixed"
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        blocks = find_blocks(net, self.block_classes, "trainer.strategy.init_args.block_classes") if self.block_classes else []
        if self.activation_checkpointing and blocks:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                apply_activation_checkpointing,
            )

            apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, tuple(self.block_classes)))
            blocks = find_blocks(net, self.block_classes, "trainer.strategy.init_args.block_classes")
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(net, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        net._lit_dist_sharded = True

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Lightning's load, checked first against the model: a tensor of another shape or name is one
        clear error instead of DCP's traceback, and those the module may lack (its ``optional_state``, e.g. a
        weight average turned on at this resume) are left out of the load and started by ``start_unsaved``."""
        from lit_dist.ckpt import pickles, sharded
        from lit_dist.ckpt.io import TRUST

        location = str(self.broadcast(checkpoint_path))
        reader = sharded.store_reader(location, self.checkpoint_io, TRUST, trust=weights_only is False)
        if reader is None:
            path = Path(location)
            saved, is_sharded = _saved_shapes(path, weights_only)

            def load() -> dict:
                return super(FSDP2Strategy, self).load_checkpoint(path, weights_only)
        else:  # an object store: the CLI vets local folders only
            pickles.vet_sharded(location, TRUST, trust=weights_only is False, reader=reader)
            saved, is_sharded, path = sharded.saved_shapes(reader), True, location

            def load() -> dict:
                return sharded.load(self, reader, lambda url: self.checkpoint_io.load_checkpoint(url, weights_only=weights_only))
        if saved is None:
            return load()
        module = self.lightning_module
        model = {key: tuple(tensor.shape) for key, tensor in module.state_dict().items()}
        optional = getattr(module, "optional_state", lambda key: False)
        refuse(path, differences(saved, model, optional) if module.strict_loading else [])
        unsaved = [key for key in model if key not in saved and optional(key)]  # the rest: checked above
        if not unsaved:
            return load()
        # DCP loads what the module's state dict names (so the unsaved keys leave it); a whole file is loaded
        # key by key against the module, non-strictly now that every difference has been checked above.
        handles = [module.register_state_dict_post_hook(_drop(unsaved)),
                   module.register_load_state_dict_post_hook(_not_missing(unsaved))]
        strict, module.strict_loading = module.strict_loading, module.strict_loading and is_sharded
        try:
            checkpoint = load()
        finally:
            module.strict_loading = strict
            for handle in handles:
                handle.remove()
        module.start_unsaved(unsaved)
        return checkpoint


def _saved_shapes(path: Path, weights_only: bool | None) -> tuple[dict | None, bool]:
    """The model tensors' (global) shapes in the checkpoint at ``path``, and whether it is sharded (DCP)."""
    if path.is_file():
        state = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only is not False)
        return {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
                for key, value in state.get("state_dict", {}).items()}, False
    if not (path / ".metadata").is_file():
        return None, False
    from lit_dist.ckpt import sharded
    from lit_dist.ckpt.io import TRUST

    # The CLI has vetted its pickles (lit_dist.ckpt.pickles.vet_sharded): the restricted reader reads it the same.
    return sharded.saved_shapes(sharded.ShardReader(str(path), TRUST, trust=weights_only is False)), True


def _drop(keys: list[str]):
    def hook(module, state_dict, prefix, local_metadata):
        for key in keys:
            state_dict.pop(prefix + key, None)
    return hook


def _not_missing(keys: list[str]):
    def hook(module, incompatible):
        for key in keys:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
    return hook


class FSDPStrategy(LightningFSDPStrategy):
    """Lightning's FSDP (FSDP1), with the wrap and activation-checkpointing policies given as class paths."""

    def __init__(
        self,
        block_classes: list[str] | None = None,
        activation_checkpointing: bool = False,
        sharding_strategy: str = "FULL_SHARD",
        state_dict_type: str = "sharded",
        **kwargs,
    ):
        """Configure FSDP1.

        Args:
            block_classes: Import paths of the block classes each wrapped in its own FSDP unit.
            activation_checkpointing: Recompute the blocks' activations in the backward pass.
            sharding_strategy: FULL_SHARD (params, grads, optimizer state) or SHARD_GRAD_OP (grads, optimizer state).
            state_dict_type: sharded (each rank saves its shard, a folder) or full (one file gathered on rank 0).
        """
        classes = set(import_classes(block_classes or [], "trainer.strategy.init_args.block_classes"))
        if sharding_strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
            raise ConfigError(f"trainer.strategy.init_args.sharding_strategy = {sharding_strategy!r}: use FULL_SHARD "
                              "or SHARD_GRAD_OP")
        super().__init__(auto_wrap_policy=classes or None,
                         activation_checkpointing_policy=classes if activation_checkpointing and classes else None,
                         sharding_strategy=sharding_strategy, state_dict_type=state_dict_type, **kwargs)


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's DeepSpeed strategy, which also runs on CPU processes (for tests and small runs).

    On GPUs it is Lightning's, unchanged. With ``trainer.accelerator: cpu`` it skips two of Lightning's checks,
    both about CUDA devices, not about DeepSpeed: the guard that refuses any accelerator but CUDA (added in 2022,
    when DeepSpeed itself could not run on CPU; DeepSpeed now has a CPU accelerator, gloo when oneCCL is absent)
    and the check of CUDA device indices; and it gives DeepSpeed the local rank as its device rank, where
    Lightning gives the CPU device's index (None). ZeRO 1-3 and CPU offload then train, save and resume on CPU.
    """

    def __init__(self, logging_batch_size_per_gpu: int | str = "auto", **kwargs):
        """Lightning's DeepSpeedStrategy arguments (``config``: a DeepSpeed JSON file or dict, and the rest).

        Args:
            logging_batch_size_per_gpu: DeepSpeed's micro batch when its JSON leaves it out; lit-dist sets it to data.batch_size_per_device.
        """
        super().__init__(logging_batch_size_per_gpu=logging_batch_size_per_gpu, **kwargs)
        self._micro_batch = logging_batch_size_per_gpu

    def _auto_select_batch_size(self) -> int:
        # Lightning reads the loader's batch_size, which lit-dist's loaders leave unset (the dataset returns whole
        # batches); Lightning applies logging_batch_size_per_gpu only where no JSON is given.
        return self._micro_batch if isinstance(self._micro_batch, int) else super()._auto_select_batch_size()

    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self._on_cpu():
            super().setup_environment()
            return
        # Read by DeepSpeed when it is first imported (by setup_distributed, next): its CPU accelerator.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        DDPStrategy.setup_environment(self)  # what Lightning's does after its CUDA-only guard

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        _unlink_shm_buffer(self.global_rank)

    @contextmanager
    def _device_rank(self):
        """Within: the CPU devices carry the ranks' indices, which Lightning hands DeepSpeed as ``device_rank``."""
        if not self._on_cpu():
            yield
            return
        devices = self.parallel_devices
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(devices))]
        try:
            yield
        finally:
            self.parallel_devices = devices

    def _setup_model_and_optimizer(self, *args, **kwargs):
        with self._device_rank():
            return super()._setup_model_and_optimizer(*args, **kwargs)

    def _initialize_deepspeed_inference(self, *args, **kwargs):
        with self._device_rank():
            return super()._initialize_deepspeed_inference(*args, **kwargs)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Lightning's, after one check: a resume of training on as many processes as saved the checkpoint. DeepSpeed
        partitions the optimizer state (and under ZeRO-3 the weights and their average) by process and cannot
        repartition it: elsewhere it ends in its own exception's traceback. The keys the module may lack or hold
        beyond its own (its ``optional_state``: the weight average, which model.ema turns on or off at a resume) are
        left out of DeepSpeed's strict load; those it lacked are started by ``start_unsaved`` once the whole
        checkpoint is loaded (under ZeRO-3 the weights' partitions come with the optimizer state)."""
        saved = _deepspeed_world_size(checkpoint_path)
        if saved not in (None, self.world_size) and self.lightning_module.trainer.state.fn == "fit":
            path = Path(checkpoint_path)
            path = path.parent if path.name == STATE else path  # the checkpoint's folder, as lit-dist names it
            raise ConfigError(f"the checkpoint {path} was saved by DeepSpeed on {saved} processes and this "
                              f"run has {self.world_size}: DeepSpeed resumes only on as many as saved it. Run on {saved} "
                              "processes (trainer.devices x trainer.num_nodes), or start a new run (run.run_id); "
                              f"`lit-dist export {path}` writes its weights")
        module = self.lightning_module
        optional = getattr(module, "optional_state", lambda key: False)
        unsaved: list[str] = []

        def tolerate(_, incompatible) -> None:  # the module's load_state_dict post-hook: strict about the rest
            for keys, lacked in ((incompatible.missing_keys, True), (incompatible.unexpected_keys, False)):
                for key in [k for k in keys if optional(k)]:
                    keys.remove(key)
                    if lacked:
                        unsaved.append(key)

        handle = module.register_load_state_dict_post_hook(tolerate)
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            handle.remove()
        if unsaved and hasattr(module, "start_unsaved"):
            module.start_unsaved(unsaved)
        return checkpoint


def _unlink_shm_buffer(rank: int) -> None:
    """Remove the name of this rank's shared-memory buffer of DeepSpeed's CPU all-reduce, once every rank has
    mapped every other's (DeepSpeed's ``shm_initialize`` returns only then; the barrier waits for all of them).
    DeepSpeed never removes it: each CPU run left 69 MB per rank in /dev/shm for good. The mappings stay valid;
    the memory goes with the last process that maps it, a killed one included."""
    import torch.distributed as dist

    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"  # deepspeed/ops/csrc/cpu/comm/shm.cpp
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    with suppress(FileNotFoundError):  # DeepSpeed without its shm all-reduce (ranks on several nodes, older builds)
        os.unlink(name)


def _deepspeed_world_size(path) -> int | None:
    """How many processes saved the DeepSpeed checkpoint at ``path`` (one optimizer-state file each); None if it
    holds none."""
    from lit_dist.ckpt.deepspeed_files import rank_files

    return len(rank_files(path, "optim_states")) or None


INSTALL_DEEPSPEED = "Install it with `pip install --no-build-isolation deepspeed` (bash .ci/setup does)."


def deepspeed_installed() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # ValueError: blocked as None in sys.modules
        return False


def missing_deepspeed(parse_error: str) -> str | None:
    """The message for a config that names a DeepSpeed class (the offload presets' optimizer) where DeepSpeed
    is not installed, instead of the type error the parser gives; None for any other parse error."""
    from lit_dist.errors import explain_parse_error

    named = re.search(r"class_path='(deepspeed\.[\w.]+)'", parse_error)
    if named is None or deepspeed_installed():
        return None
    field = explain_parse_error(parse_error).split(": ", 1)[0]
    return f"{field} = {named.group(1)!r} but DeepSpeed is not installed. {INSTALL_DEEPSPEED}"


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
        if on_cpu and key != "lit_dist.strategies.deepspeedstrategy":
            problems.append(f"trainer.strategy = {name!r} is Lightning's, which needs CUDA GPUs, and this run is on "
                            f"CPU (accelerator {accelerator!r}). Use lit_dist.strategies.DeepSpeedStrategy (every "
                            "configs/deepspeed_*.yaml preset does), which also runs on CPU.")
        if not deepspeed_installed():
            problems.append(f"trainer.strategy = {name!r} but DeepSpeed is not installed. {INSTALL_DEEPSPEED}")
    fsdp1 = key == "fsdp" or key.endswith(("strategies.fsdpstrategy", "fsdp.fsdpstrategy"))
    if fsdp1 and on_cpu:
        problems.append(f"trainer.strategy = {name!r} (FSDP1) needs CUDA GPUs and this machine has none. On CPU use "
                        "lit_dist.strategies.FSDP2Strategy (configs/fsdp2.yaml), which shards over gloo.")
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

    from lit_dist.launch import world_size

    if config.trainer.precision is None:
        config.trainer.precision = default_precision(config.trainer)
    problems = check_strategy(config.trainer)
    deepspeed_problems, warnings = check_deepspeed(config, world_size(config.trainer)[0])
    for warning in warnings:
        rank_zero_warn(f"lit-dist: {warning}")
    ConfigError.collect(problems + deepspeed_problems)
    init_args = getattr(config.trainer.strategy, "init_args", None)
    per_device = getattr(getattr(config.data, "init_args", config.data), "batch_size_per_device", None)
    deepspeed = "deepspeed" in strategy_name(config.trainer.strategy).lower()
    if deepspeed and init_args is not None and getattr(init_args, "logging_batch_size_per_gpu", "auto") == "auto" \
            and per_device:
        # DeepSpeed's micro batch: Lightning would guess it from the loader's batch_size, which
        # lit-dist's loaders leave unset (the dataset returns whole batches).
        init_args.logging_batch_size_per_gpu = per_device
