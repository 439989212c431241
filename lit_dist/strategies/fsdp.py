"""FSDP presets that take their settings from YAML: ``FSDP2Strategy`` (``fully_shard`` per block, then the whole
network, over every device; it runs on CPU over gloo too, so sharded training is tested without a GPU) and
``FSDPStrategy``, Lightning's FSDP (FSDP1) with the wrap and activation-checkpointing policies given as class paths.

    trainer:
      strategy:
        class_path: lit_dist.strategies.fsdp.FSDP2Strategy
        init_args:
          block_classes: [my_project.nets.Block]
"""

import importlib
from pathlib import Path

import torch
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lit_dist.ckpt.match import differences, left_out, may_lack, refuse
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
        from lit_dist.runtime.compat import set_data_parallel

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
        for block in reversed(blocks):  # inner blocks before the blocks that hold them, as fully_shard needs
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(net, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        net._lit_dist_sharded = True

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Lightning's load, checked first against the model: a tensor of another shape or name is one
        clear error instead of DCP's traceback, and those the module may lack (its ``optional_state``, e.g. a
        weight average turned on at this resume) are left out of the load and started by ``start_unsaved``."""
        from lit_dist.ckpt import sharded, vetting
        from lit_dist.ckpt.io import TRUST
        from lit_dist.model.optimizers import schedule_free

        # DCP fills an empty optimizer state by a step with zero gradients at lr 0 before loading into it, which a
        # schedule-free optimizer refuses in eval mode. Its flag is set directly: train() would add an empty entry
        # per parameter, and DCP would take the state for filled and load none of it (the load then sets the flag
        # saved).
        for optimizer in self.optimizers:
            if schedule_free(optimizer) and not optimizer.state:
                for group in optimizer.param_groups:
                    group["train_mode"] = True
        location = str(self.broadcast(checkpoint_path))
        reader = sharded.store_reader(location, self.checkpoint_io, TRUST, trust=weights_only is False)
        if reader is None:
            path = Path(location)
            saved, is_sharded = _saved_shapes(path, weights_only)

            def load() -> dict:
                return super(FSDP2Strategy, self).load_checkpoint(path, weights_only)
        else:  # an object store: the CLI vets local folders only
            vetting.vet_sharded(location, TRUST, trust=weights_only is False, reader=reader)
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
        handles = [module.register_state_dict_post_hook(left_out(unsaved)),
                   module.register_load_state_dict_post_hook(may_lack(unsaved))]
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

    # The CLI has vetted its pickles (lit_dist.ckpt.vetting.vet_sharded): the restricted reader reads it the same.
    return sharded.saved_shapes(sharded.ShardReader(str(path), TRUST, trust=weights_only is False)), True


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
