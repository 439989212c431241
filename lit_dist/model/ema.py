"""``EMA``: an exponential moving average of the network's weights, kept where the weights live.

Example (YAML)::

    model:
      ema:
        decay: 0.9999
        start_step: 1000

The average is one float32 buffer per trainable parameter of ``model.net``, named as the parameter
(``ema.average.blocks.0.weight`` beside ``net.blocks.0.weight`` in the state dict), so that

- it is where the parameter is: a whole copy on every rank under DDP and DeepSpeed ZeRO-1/2 (left out
  of DDP's buffer broadcast: every rank computes the same average), the same shards as the parameters
  under FSDP2 (a clone of the local shard, a DTensor like it: 1/world of the model per rank), and under
  ZeRO-3 the rank's partition of each parameter (``ds_tensor``, a flat slice: 1/world per rank, saved in
  that rank's own model-states file and put back together by ``lit-dist export``);
- it is saved and restored with the model under every strategy (sharded checkpoints included), so
  that a resumed run is bitwise the uninterrupted one, average included, and ``lit-dist export
  --ema`` writes the network with averaged weights;
- it is keyed by the parameters' names, never by their position (SimpleTuner #1497); frozen
  parameters (a VAE, a text encoder) have none.

It is updated after every ``every_n_steps``-th optimizer step from ``start_step`` on (once per optimizer
step, also where the strategy calls the optimizer hook for every micro-batch: DeepSpeed with gradient
accumulation), with one ``torch._foreach_lerp_`` over the local tensors: no host-device synchronisation, no
gather. The first update copies the weights; update k (k >= 1) keeps
``decay_k = min(decay, 1 - (1 + k) ** -warmup_power)`` of the average (diffusers' EMA warm-up), or ``decay``
itself when ``warmup_power`` is null.

Two more buffers travel with it: ``ema.updates``, how many updates the average has had (0: it is still the
copy made at set-up, not an average), and ``ema.starts_at``, the optimizer step of its first update. Whatever
validates, exports or samples with "the average" asks ``has_average`` (so ``lit-dist validate`` of a checkpoint,
whose loop starts at step 0, still uses it, and ``lit-dist export --ema`` of a checkpoint saved before the first
update is refused instead of writing the starting weights). Validation and the samples use the average once it
has had an update and ``evaluate`` is on, the raw weights before.
"""

import math

import torch
from torch import nn

from lit_dist.errors import ConfigError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: its ZeRO-3 partition (``ds_tensor``, itself: DeepSpeed may point it at
    other memory), a DTensor's local shard (FSDP2) or the tensor, detached."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local().detach() if hasattr(tensor, "to_local") else tensor.detach()


def _partitioned(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ZeRO-3 parameters that DeepSpeed keeps gathered between steps (``ds_persist``: small ones): a change
    of their partitions reaches the forward only once they are gathered again (``_regather``)."""
    return [p for p in params if getattr(p, "ds_persist", False)]


def _regather(persistent: list[torch.Tensor]) -> None:
    """Gather ZeRO-3's persistent parameters again from their partitions, as DeepSpeed does after each step
    (collective: every rank calls it)."""
    if persistent:
        persistent[0].partition(persistent)  # frees the gathered copy; the partitions are the truth
        persistent[0].all_gather(persistent)


def fsdp2_modules(net: nn.Module) -> list[nn.Module]:
    """The modules of ``net`` that FSDP2's ``fully_shard`` made (none where it is not used)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return []
    return [m for m in net.modules() if isinstance(m, FSDPModule)]


def reshard(modules: list[nn.Module]) -> None:
    """Drop FSDP2's gathered copies of the parameters, so that the next forward gathers them from the shards again:
    after anything changes the parameters outside a step (the average swapped in or out, a schedule-free optimizer
    moved between its points). Without it (``reshard_after_forward: false``, and always for the root module), the
    copy a forward without gradients (validation, samples) left in place was still the one swapped in, and
    ``unshard`` returns at once for a gathered module: the first training step after every validation trained on the
    average. No collective: each rank frees its own copy."""
    for module in modules:
        module.reshard()


def _before_load(ema: "EMA", *_) -> None:
    """A load pre-hook of the EMA module (a function, not a closure: the module stays copyable and picklable)."""
    ema._follow_partitions()
    ema._count = None  # ``updates`` is about to change: read it again when asked


def _before_save(ema: "EMA", *_) -> None:
    """A state-dict pre-hook of the EMA module: the schedule saved is this run's."""
    ema._follow_partitions()
    ema.starts_at.fill_(ema.first_step)


class EMA(nn.Module):
    """Exponential moving average of the network's trainable parameters (model.ema)."""

    def __init__(self, decay: float = 0.9999, every_n_steps: int = 1, start_step: int = 0,
                 warmup_power: float | None = 2 / 3, evaluate: bool = True):
        """Weight averaging.

        Args:
            decay: The share of the average kept at each update (0.999 to 0.9999 are usual).
            every_n_steps: Update after every this many optimizer steps.
            start_step: The first update (a copy of the weights) comes after this optimizer step or the next due one.
            warmup_power: Decay warm-up: update k keeps min(decay, 1 - (1 + k) ** -warmup_power); null: decay throughout.
            evaluate: Validate with the average once it has started (raw weights before it).
        """
        super().__init__()
        problems = []
        if not 0.0 <= decay < 1.0:
            problems.append(f"model.ema.decay = {decay}: must be in [0, 1), e.g. 0.9999")
        if every_n_steps < 1:
            problems.append(f"model.ema.every_n_steps = {every_n_steps}: must be >= 1")
        if start_step < 0:
            problems.append(f"model.ema.start_step = {start_step}: must be >= 0")
        if warmup_power is not None and not warmup_power > 0:
            problems.append(f"model.ema.warmup_power = {warmup_power}: must be > 0 (2/3 or 3/4 are usual), or null")
        ConfigError.collect(problems)
        self.decay, self.every_n_steps, self.start_step = decay, every_n_steps, start_step
        self.warmup_power, self.evaluate = warmup_power, evaluate
        # The first update: the first multiple of every_n_steps at or after start_step (optimizer steps count from 1).
        self.first_step = math.ceil(max(start_step, 1) / every_n_steps) * every_n_steps
        self.average = nn.Module()  # the buffers, under the parameters' own names
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        self.register_buffer("starts_at", torch.full((), self.first_step, dtype=torch.int64))
        self._count: int | None = 0  # ``updates`` on the host; None after a load, until read once
        self.names: list[str] = []
        self._params: list[nn.Parameter] = []
        self._pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._raw: list[torch.Tensor] | None = None
        self._sharded: list[nn.Module] = []  # FSDP2 modules of the network (a list: not submodules of this one)
        # ZeRO-3 partitions the parameters after attach: the average follows before it is read, loaded or saved.
        self.register_load_state_dict_pre_hook(_before_load)
        self.register_state_dict_pre_hook(_before_save)

    # -- set-up -----------------------------------------------------------------------------------

    def attach(self, net: nn.Module, partitioned_later: bool = False) -> None:
        """One float32 buffer per trainable parameter of ``net``, a clone of it where it is (a shard under FSDP2).
        Call once the parameters are final (after sharding); a second call does nothing. ``partitioned_later``
        (DeepSpeed ZeRO-3, which partitions when its engine starts): empty buffers until then, never a whole copy."""
        if self.names:
            return
        for name, param in net.named_parameters():
            if not param.requires_grad:
                continue
            *path, leaf = name.split(".")
            owner: nn.Module = self.average
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_buffer(leaf, torch.empty(0) if partitioned_later else param.detach().clone().float())
            self.names.append(name)
            self._params.append(param)
        if not self.names:
            raise ConfigError("model.ema is set but model.net has no trainable parameters to average")
        self._sharded = fsdp2_modules(net)

    def _follow_partitions(self) -> None:
        """Under ZeRO-3, once the engine has partitioned the parameters: each average becomes a float32 copy of its
        parameter's partition on this rank (what a load then overwrites; the first update overwrites it anyway)."""
        for name, param in zip(self.names, self._params, strict=True):
            part = getattr(param, "ds_tensor", None)
            *path, leaf = name.split(".")
            owner = self.average.get_submodule(".".join(path))
            if part is not None and owner._buffers[leaf].shape != part.shape:
                owner._buffers[leaf] = part.detach().float().clone()
                self._pairs = None

    def _apply(self, fn, recurse=True):
        self._pairs = None  # .to(), .float(), ...: the buffers are new tensors
        return super()._apply(fn, recurse)

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(averages, parameters) as local float32 / parameter-dtype tensors, in the same order."""
        if self._pairs is None:
            self._follow_partitions()
            averages = [_local(self.average.get_buffer(name)) for name in self.names]
            params = [_local(p) for p in self._params]
            for name, average, param in zip(self.names, averages, params, strict=True):
                # Once per set of tensors, host metadata only. A strategy that moved the parameters away after
                # attach (ZeRO-3's partitions) or cast the average would otherwise average garbage silently.
                if average.shape != param.shape or average.dtype != torch.float32:
                    raise ConfigError(
                        f"model.ema: the average of {name} is {tuple(average.shape)} {average.dtype} where the "
                        f"parameter is {tuple(param.shape)} {param.dtype}: this strategy moved or cast the weights "
                        "after the average was made; use DDP, FSDP2 or DeepSpeed")
            self._pairs = (averages, params)
        return self._pairs

    # -- the schedule (host integers only) --------------------------------------------------------------

    def started(self, step: int) -> bool:
        """Whether the schedule has made its first update (a copy) by optimizer step ``step``."""
        return bool(self.names) and step >= self.first_step

    def updates_by(self, step: int) -> int:
        """How many updates the schedule makes up to and including optimizer step ``step``."""
        return 0 if step < self.first_step else (step - self.first_step) // self.every_n_steps + 1

    def count(self) -> int:
        """How many updates the average has had (``updates``; read from the device once after a load)."""
        if self._count is None:
            self._count = int(self.updates)
        return self._count

    def has_average(self) -> bool:
        """Whether there is an average to use: at least one update, here or in the run a checkpoint came from."""
        return bool(self.names) and self.count() > 0

    def assume_updates(self, step: int) -> None:
        """An average loaded without its count (saved before lit-dist kept one): the schedule's count at ``step``."""
        self.updates.fill_(self.updates_by(step))
        self._count = self.updates_by(step)

    def weight(self, step: int) -> float | None:
        """The lerp weight (1 - decay_k) of the update after optimizer step ``step``; None: no update then."""
        if step < self.first_step or step % self.every_n_steps:
            return None
        k = (step - self.first_step) // self.every_n_steps
        if k == 0:
            return 1.0  # the first update copies the weights
        decay = self.decay if self.warmup_power is None else min(self.decay, 1.0 - (1.0 + k) ** -self.warmup_power)
        return 1.0 - decay

    # -- every optimizer step ---------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after optimizer step ``step``, if an update is due then."""
        weight = self.weight(step)
        if weight is None:
            return
        averages, params = self._tensors()
        if params[0].dtype != torch.float32:  # bf16 parameters (bf16-true): averaged in float32
            params = [p.float() for p in params]
        torch._foreach_lerp_(averages, params, weight)
        self.updates.add_(1)  # on the device: no synchronisation
        if self._count is not None:
            self._count += 1

    @torch.no_grad()
    def restart(self) -> None:
        """Copy the weights into the average (a checkpoint without one was loaded into the parameters): a starting
        point, not yet an update."""
        averages, params = self._tensors()
        torch._foreach_copy_(averages, [p.float() for p in params])
        self.updates.zero_()
        self._count = 0

    # -- evaluation with the average --------------------------------------------------------------------

    @torch.no_grad()
    def swap_in(self) -> None:
        """Put the average into the parameters, keeping the raw weights to put back (``swap_out``)."""
        averages, params = self._tensors()
        self._raw = [p.clone() for p in params]
        torch._foreach_copy_(params, averages)
        _regather(_partitioned(self._params))
        reshard(self._sharded)

    @property
    def swapped(self) -> bool:
        """Whether the parameters hold the average (between swap_in and swap_out)."""
        return self._raw is not None

    @torch.no_grad()
    def swap_out(self) -> None:
        """Put the raw weights back, bitwise."""
        if self._raw is None:
            return
        torch._foreach_copy_(self._tensors()[1], self._raw)
        self._raw = None
        _regather(_partitioned(self._params))
        reshard(self._sharded)
