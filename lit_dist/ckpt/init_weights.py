"""The weights a new run's network starts from (``model.init_weights``).

Any of: a file ``lit-dist export`` wrote; a checkpoint lit-dist or Lightning writes, of any strategy (its network's
weights alone: the run still starts at step 0, with a new optimizer and schedule); a state dict saved by other code
(``.safetensors``, or ``torch.save``'s ``.pt``/``.pth``/``.bin``, read with ``weights_only``). Every tensor of the
network must be matched by name and shape, except those ``model.init_weights_skip`` names (a new head): a mismatch
is one line naming the first tensor that differs, never a partly loaded network.

Loaded on every rank when the model is built, before an adapter wraps the network and before any strategy shards
it, so DDP, FSDP2 and DeepSpeed (ZeRO-3 partitions the parameters later, in its engine) all start from it alike.
"""

import os
from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from lit_dist.ckpt.export import EMA_PREFIX, load_checkpoint_state
from lit_dist.ckpt.match import differences
from lit_dist.errors import ConfigError, DataError

# What wraps a network's names in the files users bring: LitModel's own (net.), DDP's and DeepSpeed's (module.,
# _forward_module.), torch.compile's (_orig_mod.), and the "model." of many training scripts' checkpoints.
WRAPPERS = ("net.", "module.", "_forward_module.", "_orig_mod.", "model.")


def start_from(net: nn.Module, path: str, skip: Sequence[str] = ()) -> str:
    """Load ``path``'s weights into ``net`` in place, all but the tensors ``skip`` names (fnmatch patterns; a
    pattern without a wildcard also names every tensor under it: ``head`` is ``head.weight`` and ``head.bias``).
    Returns the line to print; raises ConfigError (exit 2) for a file that does not fit ``net``."""
    if not os.path.exists(path):
        raise ConfigError(f"model.init_weights = {path!r}: no such file or folder")
    state = _read(path)
    averaged = any(key.startswith(EMA_PREFIX) for key in state)
    own = net.state_dict()
    state = _named_as(state, own.keys())
    left = {name for name in own.keys() | state.keys() if _skipped(name, skip)}
    unused = [pattern for pattern in skip if not any(_skipped(name, [pattern]) for name in left)]
    if unused:
        raise ConfigError(f"model.init_weights_skip: {unused[0]!r} names no tensor of model.net or of "
                          f"{path} (model.net's first: {', '.join(list(own)[:3])}): fix the pattern or leave it out")
    saved = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items() if k not in left}
    wanted = {k: tuple(v.shape) for k, v in own.items() if k not in left}
    if wanted and not saved.keys() & wanted.keys():
        raise ConfigError(f"model.init_weights: none of the {len(saved)} tensors of {path} is named as model.net's "
                          f"(its first: {next(iter(saved), 'none')}; model.net's: {next(iter(wanted))}): weights of "
                          "another network?")
    found = differences(saved, wanted)
    if found:
        more = {1: "", 2: " (1 more tensor differs)"}.get(len(found), f" ({len(found) - 1} more tensors differ)")
        raise ConfigError(f"model.init_weights: {path} {found[0]}{more}. Name the tensors to leave at their "
                          "initialisation in model.init_weights_skip (a new head: its name, as head), or use weights "
                          "saved from this model.net")
    net.load_state_dict({k: v for k, v in state.items() if k not in left}, strict=False)
    kept = f"; {len(left & own.keys())} left at their initialisation ({', '.join(sorted(skip))})" if left else ""
    average = (" (its weight average is not used: `lit-dist export CHECKPOINT --ema true --output FILE` writes it "
               "as a file to start from)") if averaged else ""
    return f"lit-dist: model.net starts from {path}: {len(wanted)} tensors{kept}{average}"


def _read(path: str) -> dict:
    if path.endswith(".safetensors"):
        from lit_dist.runtime.extras import require

        require("safetensors", "model.init_weights (a .safetensors file)")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError) as exc:
            raise DataError(f"model.init_weights: {path} cannot be read as safetensors: {exc}") from None
    opt_in = (f"convert it once with `lit-dist export {path} --trust_pickle true --output weights.safetensors` and "
              "name that file as model.init_weights")
    return load_checkpoint_state(path, opt_in=opt_in)


def _named_as(state: dict, names) -> dict:
    """``state`` with the wrappers' prefixes (up to three, one inside another) taken off its names, as matches most
    of ``names``."""
    names = set(names)
    best, wrapped = state, [state]
    for _ in range(3):
        wrapped = [stripped for option in wrapped for prefix in WRAPPERS
                   if (stripped := {k[len(prefix):]: v for k, v in option.items() if k.startswith(prefix)})]
        best = max([best, *wrapped], key=lambda option: len(option.keys() & names))  # the first of the best: fewest taken off
    return best


def _skipped(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) or (not any(c in p for c in "*?[") and name.startswith(p + "."))
               for p in patterns)
