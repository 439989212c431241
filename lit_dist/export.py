"""Consolidated model files: a plain ``state_dict`` of the wrapped network, loadable without lit-dist.

Used by the end-of-fit ExportModel callback and by ``lit-dist export`` (lit_dist/commands/export.py).
Reads a lit-dist checkpoint folder (verified against its manifest first), a Lightning
checkpoint file (DDP, single device, FSDP full), a sharded folder (FSDP2 / FSDP1 sharded,
torch.distributed.checkpoint) and a DeepSpeed ZeRO folder.
"""

import os
import tempfile

import torch

from lit_dist.errors import DataError

NET_PREFIX = "net."


def strip_prefix(state: dict, prefix: str = NET_PREFIX) -> dict:
    """The wrapped network's entries of a LightningModule state dict (LitModel keeps it as ``net``)."""
    # DeepSpeed checkpoints of Lightning < 2.1 name everything under the strategy's wrapper.
    state = {k.removeprefix("_forward_module."): v for k, v in state.items()}
    if any(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return dict(state)


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


def load_checkpoint_state(path: str) -> dict:
    """The LightningModule state dict held by any checkpoint lit-dist or Lightning writes."""
    path = lit_dist_checkpoint(path) or path
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "latest")) or any(n.startswith("global_step") for n in os.listdir(path)):
            return _deepspeed_state(path)
        if os.path.exists(os.path.join(path, ".metadata")):
            return _dcp_state(path)
        raise DataError(f"{path} is a folder but neither a DeepSpeed checkpoint (no 'latest') nor a sharded "
                        "torch.distributed checkpoint (no '.metadata')")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        # Lightning checkpoints can hold hyperparameters that weights_only refuses (e.g. a config
        # namespace); only do this for files you trust, as for any pickle.
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint.get("state_dict", checkpoint)


def _dcp_state(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(path, target)
        checkpoint = torch.load(target, map_location="cpu", weights_only=False)
    state = checkpoint.get("state_dict", checkpoint)
    return state.get("model", state) if isinstance(state.get("model"), dict) else state


def _deepspeed_state(path: str) -> dict:
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise DataError(f"{path} is a DeepSpeed checkpoint; converting it needs DeepSpeed: "
                        "pip install --no-build-isolation deepspeed") from exc
    return get_fp32_state_dict_from_zero_checkpoint(path)

