"""Checkpoint folders vetted before a full unpickler sees them: torch's sharded-checkpoint reader and DeepSpeed's
loader unpickle every file they read in full, so lit-dist first reads their pickles with its restricted unpickler
(``pickles``) and refuses a type beyond lit-dist's own, unless the user trusts the folder."""

import io
import os

from lit_dist.ckpt import pickles
from lit_dist.ckpt.deepspeed_files import is_deepspeed, tag_folder


def vet_sharded(folder: str, opt_in: str, *, trust: bool = False, reader=None) -> None:
    """Refuse a sharded checkpoint (a ``torch.distributed.checkpoint`` folder) whose pickles name a type beyond
    its own, before a resume hands it to torch: ``FileSystemReader`` reads ``.metadata`` with plain
    ``pickle.load`` and its planner every non-tensor entry with ``torch.load(weights_only=False)``. Here the
    metadata is read through the restricted unpickler and each non-tensor entry with ``weights_only``; torch
    then reads the same bytes. ``trust`` (the user's opt-in) skips it. ``reader``: the folder's
    ``lit_dist.ckpt.sharded.ShardReader`` (one on an object store); by default a local one."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from lit_dist.ckpt.sharded import ShardReader

    if trust:
        return
    reader = reader or ShardReader(folder, opt_in)
    metadata = reader.read_metadata()
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue  # a tensor's bytes: raw storage, no pickle
        where = f"{folder.rstrip('/')}/{info.relative_path} (entry {index.fqn})"
        if getattr(info, "transform_descriptors", None):
            raise pickles.UntrustedPickle(f"{where} is stored through {', '.join(info.transform_descriptors)}, which "
                                  f"lit-dist cannot check before torch unpickles it. If you trust the file and where "
                                  f"it came from: {opt_in}")
        with reader.open(info.relative_path) as f:
            f.seek(info.offset)
            pickles.load(io.BytesIO(f.read(info.length)), opt_in, where=where)


def vet_deepspeed(folder: str, opt_in: str, *, trust: bool = False) -> None:
    """Refuse a DeepSpeed checkpoint whose files name a type beyond DeepSpeed's own few: DeepSpeed loads every
    file as a full pickle (its resume and its converter to one state dict). Each file is loaded here first
    with ``weights_only``, memory-mapped, so no tensor is read. ``trust`` (the user's opt-in) skips it."""
    if trust:
        return
    for root, _, names in os.walk(tag_folder(folder)):
        for name in sorted(n for n in names if n.endswith(".pt")):
            pickles.load(os.path.join(root, name), opt_in, allowed=pickles.deepspeed_types(), mmap=True)


def vet(path: str, opt_in: str, *, trust: bool = False) -> None:
    """Refuse a local checkpoint folder that a resume would hand to a full unpickler (a sharded or DeepSpeed
    checkpoint) if it names a type beyond its own; a single file needs nothing here (it is loaded through
    ``pickles.load``)."""
    if trust or not os.path.isdir(path):
        return
    if os.path.isfile(os.path.join(path, ".metadata")):
        vet_sharded(path, opt_in)
    elif is_deepspeed(path):
        vet_deepspeed(path, opt_in)
