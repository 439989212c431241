"""Consolidated model files: a plain ``state_dict`` of the wrapped network, loadable without lit-dist.

Used by the end-of-fit ExportModel callback and by ``lit-dist export`` (lit_dist/cli/commands/export.py).
Reads a lit-dist checkpoint folder (verified against its manifest first), a Lightning
checkpoint file (DDP, single device, FSDP full), a sharded folder (FSDP2 / FSDP1 sharded,
torch.distributed.checkpoint) and a DeepSpeed ZeRO folder. Every one is unpickled with
``weights_only`` and the few types lit-dist's checkpoints hold (lit_dist/ckpt/pickles.py), unless
the caller trusts it (``lit-dist export --trust_pickle``).
"""

import os
import zipfile

import torch

from lit_dist.errors import ConfigError, DataError

NET_PREFIX = "net."


def strip_prefix(state: dict, prefix: str = NET_PREFIX) -> dict:
    """The wrapped network's entries of a LightningModule state dict (LitModel keeps it as ``net``)."""
    # DeepSpeed checkpoints of Lightning < 2.1 name everything under the strategy's wrapper.
    state = {k.removeprefix("_forward_module."): v for k, v in state.items()}
    if any(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


EMA_PREFIX = "ema.average."


def network_state(state: dict, ema: bool = False) -> dict:
    """The wrapped network's entries of a LitModel state dict; with ``ema``, its trainable parameters replaced by
    their weight average (model.ema keeps it as ``ema.average.<parameter name>``). DataError where there is none,
    ConfigError where it has had no update (the copy of the starting weights)."""
    net = strip_prefix(state)
    if not ema:
        return net
    averages = {k[len(EMA_PREFIX):]: v for k, v in state.items() if k.startswith(EMA_PREFIX)}
    if not averages:
        raise DataError("the checkpoint holds no weight average: its run had no model.ema (leave out --ema)")
    updates = state.get("ema.updates")  # absent in checkpoints saved before lit-dist counted them
    if updates is not None and int(updates) == 0:
        starts = state.get("ema.starts_at")
        after = f"after optimizer step {int(starts)}" if starts is not None else "at model.ema.start_step"
        raise ConfigError(f"--ema: the checkpoint's weight average has had no update yet (it starts {after}): it "
                          "holds the weights the run started from. Leave out --ema, or use a checkpoint saved after "
                          "that step")
    unknown = sorted(set(averages) - set(net))
    if unknown:
        raise DataError(f"the checkpoint's weight average names parameters its network lacks: {', '.join(unknown[:3])}")
    return net | averages


def to_full_precision(state: dict) -> dict:
    """Floating-point tensors as float32 (half-precision training keeps bf16/fp16 copies), all on CPU."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def save_atomically(state: dict, path: str) -> None:
    """torch.save to a temporary file in the same folder, fsync, rename: never a torn file at ``path``."""
    from lit_dist.ckpt.files import filesystem, write_atomically

    fs, fs_path = filesystem(os.path.abspath(path))
    write_atomically(fs, fs_path, lambda f: torch.save(state, f))


def lit_dist_checkpoint(path: str) -> str | None:
    """The verified state file of a lit-dist checkpoint folder (or of the newest usable one in a
    checkpoints folder, chosen as ``ckpt_path: auto`` would); None when ``path`` is not one of those."""
    from lit_dist.ckpt import resume
    from lit_dist.ckpt.store import CheckpointStore

    path = os.path.abspath(path)
    named = resume.explicit(path)
    if named is not None:
        if named.name is None:
            raise DataError(f"checkpoint {path} is unusable: {named.damaged[0][1]}")
        return named.state
    store = CheckpointStore(path)
    if not (os.path.isdir(path) and store.names()):
        return None
    choice = resume.newest_usable(store)
    if choice.name is None:
        found = choice.problem if not choice.fresh_start else f"only unfinished saves in {path} (no marker)"
        raise DataError(f"no usable checkpoint: {found}")
    return choice.state


TRUST = "run the command again with --trust_pickle true"


def load_checkpoint_state(path: str, trust_pickle: bool = False, opt_in: str = TRUST, mmap: bool = False) -> dict:
    """The LightningModule state dict held by any checkpoint lit-dist or Lightning writes.

    ``trust_pickle`` unpickles every type the files name (only for files the user trusts); otherwise
    a file naming a type beyond lit-dist's own raises ``UntrustedPickle`` (a DataError) ending with ``opt_in``.
    ``mmap``: a file's tensors stay in its memory map, read as they are used (torch.save's zip format; the legacy one
    of torch < 1.6 is read whole).
    """
    from lit_dist.ckpt import pickles
    from lit_dist.ckpt.deepspeed_files import is_deepspeed

    path = lit_dist_checkpoint(path) or path
    if os.path.isdir(path):
        if is_deepspeed(path):
            return _deepspeed_state(path, trust_pickle, opt_in)
        if os.path.exists(os.path.join(path, ".metadata")):
            return _dcp_state(path, trust_pickle, opt_in)
        raise DataError(f"{path} is a folder but neither a DeepSpeed checkpoint (no 'latest') nor a sharded "
                        "torch.distributed checkpoint (no '.metadata')")
    checkpoint = pickles.load(path, opt_in, trust=trust_pickle, mmap=mmap and zipfile.is_zipfile(path))
    return checkpoint.get("state_dict", checkpoint)


def _dcp_state(path: str, trust: bool, opt_in: str) -> dict:
    """The module's tensors of a sharded checkpoint, read without its pickled non-tensor entries.

    torch's own converter (``dcp_to_torch_save``) unpickles the `.metadata` file and every non-tensor
    entry with plain pickle and writes the whole checkpoint, optimizer included, to a temporary file;
    here only the metadata is unpickled (restricted) and only the module's tensors are read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lit_dist.ckpt.sharded import ShardReader

    reader = ShardReader(path, opt_in, trust=trust)
    tensors = {k: v for k, v in reader.read_metadata().state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    # Lightning keeps the module under "state_dict" (ModelParallelStrategy, FSDP2) or "model" (FSDP1 sharded).
    prefix = next((p for p in ("state_dict.", "model.") if any(k.startswith(p) for k in tensors)), "")
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in tensors.items() if k.startswith(prefix)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in state.items()}


def _deepspeed_state(path: str, trust: bool, opt_in: str) -> dict:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise DataError(f"{path} is a DeepSpeed checkpoint; converting it needs DeepSpeed: "
                        "pip install --no-build-isolation deepspeed") from exc
    from lit_dist.ckpt import vetting

    vetting.vet_deepspeed(path, opt_in, trust=trust)  # its converter loads every file as a full pickle
    return _zero3_averages(path, get_fp32_state_dict_from_zero_checkpoint(path), trust, opt_in)


def _zero3_averages(path: str, state: dict, trust: bool, opt_in: str) -> dict:
    """``state`` with each ZeRO-3 weight average put back together. Under ZeRO-3 every rank keeps the average of its
    own partition of each parameter (a flat slice, the last one padded) in its own model-states file, where
    DeepSpeed's converter takes buffers from rank 0's file only: the ranks' slices, in rank order, cut to the
    parameter's size and shaped like it."""
    from lit_dist.ckpt import pickles
    from lit_dist.ckpt.deepspeed_files import rank_files

    partitioned = [k for k in state if k.startswith(EMA_PREFIX)
                   and state[k].shape != state.get("net." + k[len(EMA_PREFIX):], state[k]).shape]
    if not partitioned:
        return state
    files = rank_files(path, "model_states")
    ranks = [pickles.load(f, opt_in, trust=trust, allowed=pickles.deepspeed_types(), mmap=True)["module"] for f in files]
    for key in partitioned:
        shape = state["net." + key[len(EMA_PREFIX):]].shape
        whole = torch.cat([rank[key].reshape(-1) for rank in ranks])
        if whole.numel() < shape.numel():
            raise DataError(f"{path}: the weight average {key[len(EMA_PREFIX):]} has {whole.numel()} values in "
                            f"{len(files)} rank file(s) for a parameter of {shape.numel()}: a rank's file is missing")
        state[key] = whole[: shape.numel()].float().view(shape).clone()
    return state
