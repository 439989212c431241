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
from collections.abc import Callable, Iterator, Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from lit_dist.ckpt.export import EMA_PREFIX, load_checkpoint_state
from lit_dist.ckpt.match import differences
from lit_dist.errors import ConfigError, DataError

# What wraps a network's names in the files users bring: LitModel's own (net.), DDP's and DeepSpeed's (module.,
# _forward_module.), torch.compile's (_orig_mod.), and the "model." of many training scripts' checkpoints.
WRAPPERS = ("net.", "module.", "_forward_module.", "_orig_mod.", "model.")
CHUNK_BYTES = 1 << 30  # tensors of a file copied into the network per load_state_dict: the most held twice at once


def start_from(net: nn.Module, path: str, skip: Sequence[str] = ()) -> str:
    """Load ``path``'s weights into ``net`` in place, all but the tensors ``skip`` names (fnmatch patterns; a
    pattern without a wildcard also names every tensor under it: ``head`` is ``head.weight`` and ``head.bias``).
    Returns the line to print; raises ConfigError (exit 2) for a file that does not fit ``net``.

    The ranks of a node read a file through the page cache they share (memory-mapped), and each copies it into its
    network a gigabyte at a time instead of first reading all of it into memory of its own (checkpoint folders,
    sharded or DeepSpeed's, are read whole)."""
    if not os.path.exists(path):
        raise ConfigError(f"model.init_weights = {path!r}: no such file or folder")
    tensor, shapes = _open(path)
    averaged = any(key.startswith(EMA_PREFIX) for key in shapes)
    own = net.state_dict()
    names = _named_as(shapes.keys(), own.keys())  # the network's name -> the file's
    left = {name for name in own.keys() | names.keys() if _skipped(name, skip)}
    unused = [pattern for pattern in skip if not any(_skipped(name, [pattern]) for name in left)]
    if unused:
        raise ConfigError(f"model.init_weights_skip: {unused[0]!r} names no tensor of model.net or of "
                          f"{path} (model.net's first: {', '.join(list(own)[:3])}): fix the pattern or leave it out")
    saved = {name: shapes[key] for name, key in names.items() if name not in left}
    wanted = {name: tuple(value.shape) for name, value in own.items() if name not in left}
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
    for chunk in _chunks(list(wanted), own):
        net.load_state_dict({name: tensor(names[name]) for name in chunk}, strict=False)
    kept = f"; {len(left & own.keys())} left at their initialisation ({', '.join(sorted(skip))})" if left else ""
    average = (" (its weight average is not used: `lit-dist export CHECKPOINT --ema true --output FILE` writes it "
               "as a file to start from)") if averaged else ""
    return f"lit-dist: model.net starts from {path}: {len(wanted)} tensors{kept}{average}"


def init_weights_of(config: dict) -> tuple[str | None, list[str]]:
    """``model.init_weights`` and ``model.init_weights_skip`` of a run's saved config (a dict of its config.yaml)."""
    model = (config.get("model") or {}).get("init_args") or config.get("model") or {}
    return model.get("init_weights"), list(model.get("init_weights_skip") or ())


def _open(path: str) -> tuple[Callable[[str], torch.Tensor], dict]:
    """The tensor of a name in the file (a .safetensors file's read when asked for, from its memory map), and the
    file's shapes by name (None for an entry that is no tensor)."""
    if path.endswith(".safetensors"):
        from lit_dist.runtime.extras import require

        require("safetensors", "model.init_weights (a .safetensors file)")
        from safetensors import SafetensorError, safe_open

        try:
            file = safe_open(path, "pt")
            return file.get_tensor, {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}
        except (SafetensorError, OSError) as exc:
            raise DataError(f"model.init_weights: {path} cannot be read as safetensors: {exc}") from None
    opt_in = (f"convert it once with `lit-dist export {path} --trust_pickle true --output weights.safetensors` and "
              "name that file as model.init_weights")
    state = load_checkpoint_state(path, opt_in=opt_in, mmap=True)  # sharded and DeepSpeed folders: read whole
    return state.__getitem__, {key: tuple(v.shape) if isinstance(v, torch.Tensor) else None for key, v in state.items()}


def _named_as(keys, names) -> dict[str, str]:
    """The file's ``keys`` by the network's ``names``, matched with the wrappers' prefixes (up to three, one inside
    another) taken off either side, as matches most of them: a file of a LightningModule into its bare network, or
    a bare diffusers model's file into the network that holds it as ``model``. Keys matched to no name keep their
    own, prefixes off."""
    best, most, key_options = {key: key for key in keys}, -1, _unwrapped(keys)
    for name_of in _unwrapped(names):  # the first of the best: fewest prefixes taken off
        for key_of in key_options:
            matched = len(key_of.keys() & name_of.keys())
            if matched > most:
                best, most = {name_of.get(bare, bare): key for bare, key in key_of.items()}, matched
    return best


def _unwrapped(keys) -> list[dict[str, str]]:
    """``keys`` as they are, then with each chain of up to three wrappers' prefixes taken off those that have it:
    each a dict of the names left -> the key."""
    options = wrapped = [{key: key for key in keys}]
    for _ in range(3):
        wrapped = [stripped for option in wrapped for prefix in WRAPPERS
                   if (stripped := {k[len(prefix):]: v for k, v in option.items() if k.startswith(prefix)})]
        options = options + wrapped
    return options


def _chunks(names: list[str], own: dict) -> Iterator[list[str]]:
    chunk, size = [], 0
    for name in names:
        chunk.append(name)
        size += own[name].numel() * own[name].element_size()
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _skipped(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, p) or (not any(c in p for c in "*?[") and name.startswith(p + "."))
               for p in patterns)
