"""Writing one checkpoint: the files, every rank's agreement that it worked, the marker, rotation, and the
asynchronous variant. The ``Checkpointing`` callback decides when; this decides nothing, it saves.

- Rank 0 writes the file for DDP and single-device runs; with sharded strategies (FSDP, FSDP2,
  DeepSpeed) every rank writes its part, the ranks hash a share of the files each, and rank 0 writes
  the marker once all are done. A checkpoint counts only once its marker exists (``lit_dist.ckpt.store``).
- Every rank learns whether the save failed on any rank (one small all-reduce per save), so no rank
  waits for one that gave up.
- ``async_save``: a quick copy of the state (``Snapshot``), then the write on a thread; the next save
  (or the end of the run) waits for it and agrees on its outcome.
- After a save, rotation keeps the newest ``keep_last_n``, the best ``keep_best_k`` by ``monitor`` and
  the checkpoint the run resumed from; ``checkpoint.saved`` is published.
"""

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from lit_dist import compat
from lit_dist.ckpt.files import FileEntry, hash_file
from lit_dist.ckpt.io import AtomicCheckpointIO
from lit_dist.ckpt.snapshot import Snapshot
from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore, checkpoint_name
from lit_dist.distributed import agree_any, all_gather_object
from lit_dist.errors import CheckpointError
from lit_dist.run import RUN_ID_ENV

log = logging.getLogger(__name__)


@dataclass
class Rotation:
    """Which complete checkpoints rotation keeps (see ``Checkpointing``'s arguments)."""

    keep_last_n: int = 3
    monitor: str | None = None
    mode: str = "min"
    keep_best_k: int = 1


class Saver:
    """Saves the trainer's state as one complete checkpoint in ``store``; call ``save`` on every rank."""

    def __init__(self, store: CheckpointStore, io: AtomicCheckpointIO, rotation: Rotation, async_save: bool = False,
                 published: Callable[[dict], None] | None = None):
        self.store = store
        self.io = io
        self.rotation = rotation
        self.async_save = async_save
        self.published = published  # told about every finished checkpoint (rank 0): the checkpoint.saved event
        self.resumed_from: str | None = None  # never deleted by rotation
        self.last_path: str | None = None  # the newest complete checkpoint this run wrote
        self.last_saved_step = -1
        self.last_save_time = time.monotonic()
        self._snapshot = Snapshot()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit-dist-save")
        self._pending: Future | None = None  # the asynchronous write in flight

    def save(self, trainer, reason: str, metric: dict | None = None) -> str:
        """Save a checkpoint of this step now and return where (every rank). Call it on every rank at the
        same step: it holds collectives."""
        store = self.store
        step = trainer.global_step
        name = checkpoint_name(step)
        self.wait_for_save(trainer)
        if step == self.last_saved_step:
            if metric and trainer.is_global_zero:
                store.set_metric(name, metric)  # validation right after a step save: same weights
            return store.url_of(name)
        self.last_saved_step = step
        self.last_save_time = time.monotonic()
        info = {"step": step, "epoch": trainer.current_epoch, "reason": reason, "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__, "run_id": os.environ.get(RUN_ID_ENV), "metric": metric}
        target = "/".join([store.staging(name), STATE]) if store.local else store.url_of(name, STATE)
        whole_on_rank_zero = compat.rank_zero_writes(trainer.strategy)
        started = time.monotonic()
        if self.async_save and whole_on_rank_zero:
            checkpoint = compat.dump_checkpoint(trainer)
            if trainer.is_global_zero:
                state = self._snapshot.take(checkpoint)

                blocked = time.monotonic() - started  # the loop waits only for the copy

                def write() -> None:
                    store.begin(name)
                    self.io.save_checkpoint(state, target)
                    self._finish(name, {STATE: self.io.written.pop(target)}, info, started, blocked)

                self._pending = self._writer.submit(write)
            return store.url_of(name)
        error = None
        try:
            if trainer.is_global_zero:
                store.begin(name)
            if not whole_on_rank_zero:
                trainer.strategy.barrier("lit-dist-checkpoint-begin")  # the folder is fresh before any rank writes
            trainer.strategy.save_checkpoint(compat.dump_checkpoint(trainer), target)
        except Exception as exc:  # agreed on below, so that no rank waits for one that gave up
            error = exc
        files = self._files(trainer, name, target, whole_on_rank_zero)
        if trainer.is_global_zero and error is None:
            try:
                self._finish(name, files, info, started)
            except Exception as exc:
                error = exc
        self._agree_saved(trainer, name, error)
        return store.url_of(name)

    def _files(self, trainer, name: str, target: str, whole_on_rank_zero: bool) -> dict[str, FileEntry]:
        """Every file of the checkpoint with its size and sha256, on rank 0 (collective for sharded strategies)."""
        written = self.io.written.pop(target, None)
        files = {STATE: written} if written else {}
        store = self.store
        if whole_on_rank_zero:
            if trainer.is_global_zero and not files:  # a CheckpointIO of the user's own wrote it
                path = target if store.local else store.path(name, STATE)
                files = {STATE: hash_file(store.fs, path, fsync=True)}
            return files
        # Sharded: the strategy wrote files through its own code. Each rank lists the folder (its own files
        # are surely there), then hashes and fsyncs a share of them.
        staging = store.staging(name)
        listing = [os.path.relpath(os.path.join(folder, f), staging) for folder, _, names in os.walk(staging) for f in names]
        everyone = all_gather_object(trainer, (listing, files))
        known = {rel: entry for _, theirs in everyone for rel, entry in theirs.items()}
        todo = sorted({rel for seen, _ in everyone for rel in seen} - set(known) - {MARKER})
        mine = {rel: hash_file(store.fs, os.path.join(staging, rel), fsync=True)
                for rel in todo[trainer.global_rank :: trainer.world_size]}
        for part in all_gather_object(trainer, mine):
            known.update(part)
        return known

    def _finish(self, name: str, files: dict[str, FileEntry], info: dict, started: float,
                blocked: float | None = None) -> None:
        """Rank 0, once every rank wrote: marker, rotation, the checkpoint.saved event (``blocked``: seconds the
        training loop waited, when not all of it)."""
        store, rotation = self.store, self.rotation
        manifest = store.finish(name, files, info)
        self.last_path = store.url_of(name)
        deleted = store.rotate(rotation.keep_last_n, {name} | ({self.resumed_from} if self.resumed_from else set()),
                               rotation.monitor, rotation.mode, rotation.keep_best_k)
        seconds = time.monotonic() - started
        size = sum(entry.size for entry in files.values())
        log.info("lit-dist: saved %s (%.1f MB in %.2f s)%s", self.last_path, size / 1e6, seconds,
                 f"; removed {', '.join(deleted)}" if deleted else "")
        if self.published is not None:
            self.published({"step": manifest["step"], "epoch": manifest["epoch"], "path": self.last_path, "bytes": size,
                            "seconds": round(seconds, 3), "reason": manifest["reason"],
                            "blocked_s": round(seconds if blocked is None else blocked, 3)})

    def wait_for_save(self, trainer) -> None:
        """Wait for the save in flight; every rank learns whether it failed (a collective when saving asynchronously)."""
        if not self.async_save:
            return
        error = self.background_error()
        self._agree_saved(trainer, checkpoint_name(self.last_saved_step), error)

    def background_error(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait for the asynchronous write in flight (this rank only); its exception, reported once, else None."""
        if self._pending is None:
            return None
        try:
            self._pending.result(timeout_s)
        except FutureTimeout:
            return TimeoutError(f"the background save did not finish within {timeout_s} s")
        except BaseException as exc:  # noqa: BLE001 - the caller agrees on it with the other ranks
            self._pending = None
            return exc
        self._pending = None
        return None

    def _agree_saved(self, trainer, name: str, error: BaseException | None) -> None:
        if agree_any(trainer, error is not None):
            where = f": {type(error).__name__}: {error}" if error else " on another rank (see its log)"
            raise CheckpointError(f"saving checkpoint {name} in {self.store.url} failed{where}") from error
