"""``AtomicCheckpointIO``: Lightning's checkpoint file I/O, written atomically, loaded with ``weights_only``.

Lightning's ``TorchCheckpointIO`` serialises the whole checkpoint into memory first and moves a
temporary file from ``$TMPDIR`` (not atomic across filesystems). This one streams ``torch.save``
into a temporary file next to the target, hashes it on the way, and remembers each file's size and
sha256 for the checkpoint's manifest, so nothing is read back to hash it.
"""

import logging
import pickle
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lit_dist.ckpt.files import FileEntry, filesystem, write_atomically

log = logging.getLogger(__name__)


class AtomicCheckpointIO(CheckpointIO):
    """Saves each checkpoint file complete or not at all; loads it with ``weights_only=True`` when it can."""

    def __init__(self, storage_options: dict | None = None):
        self.storage_options = storage_options or {}
        self.written: dict[str, FileEntry] = {}  # path -> entry, taken by whoever writes the manifest

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        fs, fs_path = filesystem(str(path), {**self.storage_options, **(storage_options or {})})
        self.written[str(path)] = write_atomically(fs, fs_path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        fs, fs_path = filesystem(str(path), self.storage_options)
        if not fs.exists(fs_path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        with fs.open(fs_path, "rb") as f:
            if weights_only is not False:
                try:
                    return torch.load(f, map_location=map_location or "cpu", weights_only=True)
                except pickle.UnpicklingError as exc:
                    if weights_only:
                        raise
                    # The state holds Python objects beyond tensors and containers (a model's own
                    # hyperparameters, say). lit-dist wrote it into this run's own folder.
                    log.warning("lit-dist: %s holds Python objects that weights_only loading refuses (%s); "
                                "loading it as a full pickle. Only resume from checkpoints you trust.",
                                path, str(exc).splitlines()[0][:200])
                    f.seek(0)
            return torch.load(f, map_location=map_location or "cpu", weights_only=False)

    def remove_checkpoint(self, path) -> None:
        fs, fs_path = filesystem(str(path), self.storage_options)
        if fs.exists(fs_path):
            fs.rm(fs_path, recursive=True)
