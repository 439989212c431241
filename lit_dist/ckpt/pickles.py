"""What lit-dist unpickles from a checkpoint: tensors, containers and the few types its checkpoints hold.

A checkpoint is a pickle, and unpickling one calls whatever the pickle names: a file can run any code
the moment it is loaded. ``torch.load(weights_only=True)`` builds tensors, containers and primitives
only, plus the types ``torch.serialization.safe_globals`` allows. lit-dist allows beyond torch's own
list just the types found in the checkpoints it writes (saved from the quickstart under each strategy):

=========================================  ====================================================
checkpoint                                 holds beyond torch's default allowlist
=========================================  ====================================================
one file (one device, DDP, FSDP full)      nothing
DeepSpeed ZeRO 1-3, fp32/fp16/bf16         in ``*optim_states.pt``: ``LossScaler``,
                                           ``DynamicLossScaler``, ``ZeroStageEnum``,
                                           ``fragment_address`` (all DeepSpeed's)
sharded folder (FSDP2, FSDP1 sharded)      ``meta.pt``: nothing; ``.metadata``: the dataclasses
                                           of ``torch.distributed.checkpoint.metadata``,
                                           ``torch.Size``, dtypes, a ``pathlib`` path
=========================================  ====================================================

Anything else is refused with one line naming the type and the caller's opt-in for a file the user
trusts (``lit-dist export --trust_pickle``, ``lit-dist fit --weights_only false``).
"""

import pickle
import re
import struct
import zipfile
from typing import Any

import torch

from lit_dist.errors import DataError


class UntrustedPickle(DataError):
    """A checkpoint names a type that loading would construct or call, outside what lit-dist allows."""


def deepspeed_types() -> list:
    """The DeepSpeed classes in the optimizer states of a ZeRO checkpoint (import DeepSpeed: only for those)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load(file, opt_in: str, *, trust: bool = False, allowed: list | tuple = (), map_location: Any = "cpu",
         mmap: bool = False, where: str | None = None) -> Any:
    """``torch.load`` of ``file`` (a path or a seekable binary file) with ``weights_only``, allowing ``allowed`` too.

    ``trust`` loads it as a full pickle (the user's explicit opt-in). Otherwise a file that names any
    other type raises :class:`UntrustedPickle`, whose message ends with ``opt_in`` (how to trust it) and
    starts with ``where`` (default: the file's path).
    """
    if trust:
        return torch.load(file, map_location=map_location, mmap=mmap, weights_only=False)
    where = where or (file if isinstance(file, str) else
                      getattr(file, "name", None) or getattr(file, "path", "the checkpoint"))
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(file, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        names = _refused(file, allowed, str(exc))
        if not names:  # not a refused type: the file is no torch checkpoint at all
            reason = next((line.split("error:", 1)[1].strip() for line in str(exc).splitlines() if "error:" in line),
                          str(exc).splitlines()[0])
            raise DataError(f"{where} cannot be read as a checkpoint: {reason}") from None
        raise UntrustedPickle(f"{where} holds {', '.join(names)}: loading it could run any code, so lit-dist does "
                              f"not unpickle it. If you trust the file and where it came from: {opt_in}") from None
    except (KeyError, EOFError, RuntimeError) as exc:
        # What torch.load raises for a file that is no checkpoint (a text file, a truncated zip).
        raise DataError(f"{where} cannot be read as a checkpoint: {_unreadable(file, exc)}") from exc


def _unreadable(file, exc: BaseException) -> str:
    """Why torch.load could not read ``file``, for a person: torch's own KeyError for a file that is neither a
    zip archive nor a pickle is the value of its first byte ("KeyError: 104")."""
    if isinstance(exc, KeyError):
        try:
            if not zipfile.is_zipfile(file):
                return "it is not a file that torch.save writes (neither a zip archive nor a pickle)"
        except OSError:
            pass
    return f"{type(exc).__name__}: {exc}"


def _refused(file, allowed, message: str) -> list[str]:
    """The names of the types or functions in ``file`` that weights-only loading refuses."""
    try:
        if hasattr(file, "seek"):
            file.seek(0)
        with torch.serialization.safe_globals(list(allowed)):
            names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError, struct.error, OSError):
        # What it raises for a file that is no zip checkpoint (ValueError), a damaged zip (RuntimeError from
        # torch's reader), a damaged data.pkl (UnpicklingError, EOFError, struct.error, UnicodeDecodeError) or
        # an unreadable file: the refusal's own words name the type then.
        names = []
    # A type pushed on the stack at load time escapes the static listing; torch's message names it.
    return sorted(names) or re.findall(r"Unsupported global: GLOBAL (\S+) was not an allowed global", message)


# Exactly the globals of the `.metadata` files that torch.distributed.checkpoint writes (FileSystemWriter).
_DCP_METADATA = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the types of a `.metadata` file. torch's weights-only unpickler cannot read one (pickle
    protocol 4 frames), and torch.distributed.checkpoint's FileSystemReader reads it with plain ``pickle.load``."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if name in _DCP_METADATA.get(module, ()) else None
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} was not an allowed global")
        return found


def load_dcp_metadata(file, where: str, opt_in: str, *, trust: bool = False):
    """The ``Metadata`` of a sharded checkpoint from its open ``.metadata`` file."""
    if trust:
        return pickle.load(file)
    try:
        return _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as exc:
        named = re.findall(r"GLOBAL (\S+) was not an allowed global", str(exc))
        if not named:
            raise DataError(f"{where} cannot be read as a sharded checkpoint's metadata: {exc}") from None
        raise UntrustedPickle(f"{where} holds {named[0]}: loading it could run any code, so lit-dist does not "
                              f"unpickle it. If you trust the file and where it came from: {opt_in}") from None


