"""``AtomicCheckpointIO``: Lightning's checkpoint file I/O, written atomically, loaded with ``weights_only``.

Lightning's ``TorchCheckpointIO`` serialises the whole checkpoint into memory first and moves a
temporary file from ``$TMPDIR`` (not atomic across filesystems). This one streams ``torch.save``
into a temporary file next to the target, hashes it on the way, and remembers each file's size and
sha256 for the checkpoint's manifest, so nothing is read back to hash it. Loading unpickles only
tensors, containers and the types lit-dist's checkpoints hold (lit_dist/ckpt/pickles.py). On an object
store, a file's upload (and a load) is retried whole through an outage, up to ``outage_deadline_s``.
"""

import logging
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from lit_dist.ckpt import pickles
from lit_dist.ckpt.files import FileEntry, filesystem, through_outage, write_atomically
from lit_dist.runtime import outage

log = logging.getLogger(__name__)
# Lightning's own switch (an argument of Trainer.fit / validate / test / predict, so a flag of each command).
TRUST = "run the command again with --weights_only false"


class AtomicCheckpointIO(CheckpointIO):
    """Saves each checkpoint file complete or not at all; loads it with ``weights_only=True``."""

    def __init__(self, storage_options: dict | None = None, outage_deadline_s: float = outage.DEADLINE_S):
        self.storage_options = storage_options or {}
        self.outage_deadline_s = outage_deadline_s
        self.who = ""  # starts the line of an outage ("rank 0: "), once the rank is known
        self.written: dict[str, FileEntry] = {}  # path -> entry, taken by whoever writes the manifest

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        fs, fs_path = filesystem(str(path), {**self.storage_options, **(storage_options or {})})
        # torch.save serialises the same state again on a retry: the upload of one file is idempotent.
        self.written[str(path)] = through_outage(
            fs, lambda: write_atomically(fs, fs_path, lambda f: torch.save(checkpoint, f)), "saving",
            f"step {checkpoint.get('global_step')} to {path}", self.outage_deadline_s, self.who)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads with ``weights_only`` unless ``weights_only`` is False (Lightning's ``--weights_only false``).

        A checkpoint naming any type beyond lit-dist's own (lit_dist/ckpt/pickles.py) is refused with a
        DataError naming it: unpickling it could run code, and no resume does that without being told.
        """
        fs, fs_path = filesystem(str(path), self.storage_options)
        if weights_only is False:
            log.warning("lit-dist: loading %s as a full pickle (--weights_only false): only for files you trust", path)

        def load() -> dict[str, Any]:
            if not fs.exists(fs_path):
                raise FileNotFoundError(f"checkpoint file not found: {path}")
            with fs.open(fs_path, "rb") as f:
                return pickles.load(f, TRUST, trust=weights_only is False, map_location=map_location or "cpu")

        return through_outage(fs, load, "reading", f"checkpoint {path}", self.outage_deadline_s, self.who)

    def remove_checkpoint(self, path) -> None:
        fs, fs_path = filesystem(str(path), self.storage_options)
        through_outage(fs, lambda: fs.exists(fs_path) and fs.rm(fs_path, recursive=True), "deleting",
                       f"checkpoint {path}", self.outage_deadline_s, self.who)
