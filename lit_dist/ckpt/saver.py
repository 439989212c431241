"""Writing one checkpoint: the files, every rank's agreement that it worked, the marker, rotation, and the
asynchronous variant. The ``Checkpointing`` callback decides when; this decides nothing, it saves.

- Rank 0 writes the file for DDP and single-device runs; with sharded strategies (FSDP, FSDP2,
  DeepSpeed) every rank writes its part, the ranks hash a share of the files each, and rank 0 writes
  the marker once all are done. A checkpoint counts only once its marker exists (``lit_dist.ckpt.store``).
- Every rank learns whether rank 0 made the checkpoint's folder, then whether the save failed on any
  rank (two small all-reduces per save), so no rank waits for one that gave up, and every rank runs the
  same collectives in the same order on the error path too. A failed save is removed at once; a full
  disk is one line with what to do (``StorageFull``, exit 16, see ``lit_dist.ckpt.space``), and rank 0
  warns once, after a save, when fewer than two more checkpoints fit.
- On an object store, each upload, listing and deletion waits out an outage of the store (the store's
  ``outage_deadline_s``); past it the save fails with ``StoreUnreachable`` and every rank ends with exit 17,
  whether the save was synchronous or on the background thread (then at the next save or the end of fit).
- FSDP2's sharded folder is written by ``lit_dist.ckpt.sharded`` (each rank its shard, hashed while written;
  on an object store staged in ``$TMPDIR`` and uploaded whole, retried like every other upload).
- ``async_save``: a quick copy of the state (``Snapshot``: rank 0's whole state, or each rank's shards), then the
  write on a thread (sharded: every rank's, with its collectives on a process group of its own); the next save
  (or the end of the run) waits for it and agrees on its outcome.
- After a save, rotation keeps the newest ``keep_last_n``, the best ``keep_best_k`` by ``monitor`` and
  the checkpoint the run resumed from; ``checkpoint.saved`` is published.
"""

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from dataclasses import dataclass

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException

from lit_dist.ckpt import sharded
from lit_dist.ckpt.files import FileEntry, hash_file
from lit_dist.ckpt.io import AtomicCheckpointIO
from lit_dist.ckpt.snapshot import Snapshot
from lit_dist.ckpt.space import (
    full_error,
    full_message,
    low_room_warning,
    os_errors,
    room,
    short_write,
    state_bytes,
    too_little,
)
from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore, checkpoint_name
from lit_dist.errors import CheckpointError, StorageFull
from lit_dist.runtime import compat
from lit_dist.runtime.distributed import Comm, agree_any, all_gather_object
from lit_dist.runtime.outage import StoreUnreachable
from lit_dist.runtime.run_dir import RUN_ID_ENV

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
        self._pending: Future | None = None  # the asynchronous write in flight
        self._group = None  # the process group of background sharded saves (made by the first one)
        self._state_bytes = 0  # this rank's part of the last checkpoint, in memory: its size before one is complete
        self._warned_room = False  # fewer than two more checkpoints fit: said once

    def save(self, trainer, reason: str, metric: dict | None = None) -> str:
        """Save a checkpoint of this step now and return where (every rank). Call it on every rank at the
        same step: it holds collectives."""
        store = self.store
        step = trainer.global_step
        name = checkpoint_name(step)
        self.wait_for_save(trainer)
        if step == self.last_saved_step:
            if metric:  # validation right after a step save: same weights, the value goes into its marker
                error = None
                if trainer.is_global_zero:
                    try:
                        store.set_metric(name, metric)
                    except (OSError, StoreUnreachable) as exc:
                        error = exc
                self._agree_saved(trainer, name, error)
            return store.url_of(name)
        self.last_saved_step = step
        self.last_save_time = time.monotonic()
        info = {"step": step, "epoch": trainer.current_epoch, "reason": reason, "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__, "run_id": os.environ.get(RUN_ID_ENV), "metric": metric}
        target = "/".join([store.staging(name), STATE]) if store.local else store.url_of(name, STATE)
        whole_on_rank_zero = compat.rank_zero_writes(trainer.strategy)
        started = time.monotonic()
        # The weights a checkpoint keeps (a schedule-free optimizer's average) until they are written or copied.
        with getattr(trainer.lightning_module, "weights_to_keep", nullcontext)():
            # On every rank before anything can fail: on_save_checkpoint gathers every rank's random states.
            checkpoint = compat.dump_checkpoint(trainer)
            self._state_bytes = state_bytes(checkpoint)  # the strategy may take parts of it apart while saving
            if compat.writes_dcp_shards(trainer.strategy):
                self._save_shards(trainer, name, target, checkpoint, info, started)
            elif self.async_save and whole_on_rank_zero:
                if trainer.is_global_zero:
                    self._write_in_background(name, target, checkpoint, info, started)
            else:
                self._write(trainer, name, target, checkpoint, info, started, whole_on_rank_zero)
        return store.url_of(name)

    def _write_in_background(self, name: str, target: str, checkpoint: dict, info: dict, started: float) -> None:
        """Rank 0: copy the state aside, then write it on the saver's thread (``wait_for_save`` agrees on it)."""
        store = self.store
        state = self._snapshot.take(checkpoint)
        blocked = time.monotonic() - started  # the loop waits only for the copy

        def write() -> None:
            written = False
            try:
                store.begin(name)
                self.io.save_checkpoint(state, target)
                self._finish(name, {STATE: self.io.written.pop(target)}, info, started, blocked)
                written = True
            finally:
                if not written:  # also when the run ends before the failure is agreed on
                    store.abandon(name)

        self._pending = _in_background(write)

    def _begin(self, trainer, name: str) -> BaseException | None:
        """Rank 0 makes the checkpoint's fresh folder; its error (agreed on by the caller, then raised), else None."""
        if not trainer.is_global_zero:
            return None
        try:
            self.store.begin(name)
        except Exception as exc:  # noqa: BLE001 - agreed on, then raised (see _raise)
            return exc
        return None

    def _save_shards(self, trainer, name: str, target: str, checkpoint: dict, info: dict, started: float) -> None:
        """Every rank: FSDP2's shards through DCP, now or (``async_save``) on a thread after a copy."""
        error = self._begin(trainer, name)
        if agree_any(trainer, error is not None):  # also the barrier: no rank writes before the folder is fresh
            self._agree_saved(trainer, name, error)
            return
        tensors, meta = sharded.split(checkpoint)
        rank, world = trainer.global_rank, trainer.world_size
        if not self.async_save:
            try:
                self._write_shards(name, target, tensors, meta, info, started, None, Comm(rank, world))
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on, then raised (see _raise)
                error = exc
            self._agree_saved(trainer, name, error)
            return
        if self._group is None and world > 1:  # every rank is here, at the same save: a collective is safe
            self._group = sharded.background_group(compat.collective_timeout_s(trainer.strategy))
        tensors, meta = self._snapshot.take((tensors, meta))
        blocked = time.monotonic() - started  # the loop waits only for the copy
        comm = Comm(rank, world, self._group)
        self._pending = _in_background(
            lambda: self._write_shards(name, target, tensors, meta, info, started, blocked, comm))

    def _write_shards(self, name: str, target: str, tensors: dict, meta: dict, info: dict, started: float,
                      blocked: float | None, comm: Comm) -> None:
        """Every rank, over ``comm``'s group: write this rank's shards, and rank 0 ``meta.pt``; rank 0 finishes the
        checkpoint once every rank's files are in. Raises this rank's error (another rank's is agreed on later)."""
        error, files = None, {}
        store = self.store
        try:
            if store.local:
                files = sharded.write(tensors, target, comm.group)
            else:
                folder = store.path(name)
                files = sharded.write(tensors, store.path(name, STATE), comm.group, sharded.StoreFileSystem(
                    store.fs, store.remote, lambda path: f"{store.saving(name)} (its {path[len(folder) + 1:]})"))
            if comm.rank == 0:
                path = os.path.join(target, sharded.META)
                self.io.save_checkpoint(meta, path)
                files[os.path.join(STATE, sharded.META)] = self.io.written.pop(path)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised below, after the gather every rank joins
            error = exc
        everyone = comm.all_gather((files, error is not None))
        if error is not None:
            raise error
        if comm.rank == 0 and not any(failed for _, failed in everyone):
            self._finish(name, {rel: entry for theirs, _ in everyone for rel, entry in theirs.items()}, info, started,
                         blocked)

    def _write(self, trainer, name: str, target: str, checkpoint: dict, info: dict, started: float,
               whole_on_rank_zero: bool) -> None:
        """Every rank: write now, agree on the outcome; the same collectives in the same order on every rank
        whatever fails where."""
        error = self._begin(trainer, name)
        # Every rank learns whether rank 0 made the folder, and all skip the strategy's save together if it did
        # not (the save holds collectives: FSDP2, DeepSpeed; ModelParallelStrategy broadcasts the path). It is
        # also the barrier that keeps every rank from writing before the folder is fresh.
        began = not agree_any(trainer, error is not None)
        if began:
            try:
                trainer.strategy.save_checkpoint(checkpoint, target)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - agreed on, then raised (see _raise)
                error = exc
        files, error = self._files(trainer, name, target, whole_on_rank_zero, began, error)
        if trainer.is_global_zero and error is None and files is not None:  # None: another rank failed
            try:
                self._finish(name, files, info, started)
            except Exception as exc:  # noqa: BLE001 - agreed on, then raised (see _raise)
                error = exc
        self._agree_saved(trainer, name, error)

    def _files(self, trainer, name: str, target: str, whole_on_rank_zero: bool, began: bool,
               error: BaseException | None) -> tuple[dict[str, FileEntry] | None, BaseException | None]:
        """Every file of the checkpoint with its size and sha256, on rank 0 (collective for sharded strategies
        when ``began``), and this rank's error so far (a file that cannot be hashed is one). Files are None when
        any rank failed: rank 0 must not finish a checkpoint with another rank's part missing."""
        written = self.io.written.pop(target, None)
        files = {STATE: written} if written else {}
        store = self.store
        if whole_on_rank_zero:
            if trainer.is_global_zero and not files and error is None:  # a CheckpointIO of the user's own wrote it
                path = target if store.local else store.path(name, STATE)
                try:
                    files = {STATE: store.remote(lambda: hash_file(store.fs, path, fsync=True), "saving",
                                                 store.saving(name))}
                except (OSError, StoreUnreachable) as exc:
                    error = exc
            return files, error
        if not began:  # agreed: no rank wrote anything
            return None, error
        # Sharded: the strategy wrote files through its own code. Each rank lists the folder (its own files
        # are surely there), then hashes and fsyncs a share of them, unless a rank failed: every rank sees that
        # in the same gathered list, so all skip the second gather together.
        staging = store.staging(name)
        listing = [os.path.relpath(os.path.join(folder, f), staging) for folder, _, names in os.walk(staging) for f in names]
        everyone = all_gather_object(trainer, (listing, files, error is not None))
        if any(failed for *_, failed in everyone):
            return None, error
        known = {rel: entry for _, theirs, _ in everyone for rel, entry in theirs.items()}
        todo = sorted({rel for seen, *_ in everyone for rel in seen} - set(known) - {MARKER})
        mine = {}
        try:
            for rel in todo[trainer.global_rank :: trainer.world_size]:
                mine[rel] = hash_file(store.fs, os.path.join(staging, rel), fsync=True)
        except OSError as exc:
            error = exc
        hashed = all_gather_object(trainer, (mine, error is not None))
        if any(failed for _, failed in hashed):  # a share left unhashed: its files would be missing from the manifest
            return None, error
        for part, _ in hashed:
            known.update(part)
        return known, error

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
        if store.local and not self._warned_room:
            self._check_room(size, len(files), bool(deleted))
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

    def failed_in_background(self) -> bool:
        """Whether this rank's asynchronous write has already failed (without waiting for one in flight)."""
        pending = self._pending
        return pending is not None and pending.done() and pending.exception() is not None

    def background_error(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait for the asynchronous write in flight (this rank only); its exception, reported once, else None."""
        if self._pending is None:
            return None
        try:
            self._pending.result(timeout_s)
        except FutureTimeout:
            return TimeoutError(f"the background save did not finish within {timeout_s} s")
        except BaseException as exc:  # noqa: BLE001 - handed on, not swallowed: the caller agrees on it and raises or logs it
            self._pending = None
            return exc
        self._pending = None
        return None

    def _check_room(self, checkpoint_bytes: int, checkpoint_files: int, deleted: bool) -> None:
        """Warn once (rank 0) when fewer than two more checkpoints fit: while freeing space is still cheap."""
        store = self.store
        here = room(store.root)
        if too_little(here, checkpoint_bytes, checkpoint_files) and deleted:
            CheckpointStore.wait_for_deletions()  # rotation frees its room on a thread: count it before warning
            here = room(store.root)
        if too_little(here, checkpoint_bytes, checkpoint_files):
            self._warned_room = True
            rank_zero_warn(low_room_warning(store.url, here, checkpoint_bytes, checkpoint_files))

    def _agree_saved(self, trainer, name: str, error: BaseException | None) -> None:
        """Every rank learns whether the save of ``name`` failed anywhere (one all-reduce); if it did, rank 0
        removes what it left, the ranks exchange what went wrong, and every rank raises (see ``_raise``)."""
        if not agree_any(trainer, error is not None):
            return
        store, facts = self.store, None
        # Before rank 0 removes the partial save: whether the disk is full is read from the room left on it.
        described = _described(error, self._state_bytes, store.root if store.local else None)
        if trainer.is_global_zero:
            store.abandon(name)  # no rank writes any more: all of them are here
            # For a full disk's message; an object store is not listed again (it may be the store that failed).
            facts = (room(store.root), *self._newest()) if store.local else (None, "", None)
        everyone = all_gather_object(trainer, (described, facts, self._state_bytes))
        self._raise(trainer, name, error, described, everyone)

    def _newest(self) -> tuple[str | None, int | None]:
        """(the newest complete checkpoint or None, its size), for the message of a failed save; ("", None) where
        the folder cannot be listed or its marker read: raising here would leave the other ranks waiting."""
        try:
            newest = next(iter(self.store.complete()), None)
            return newest, self.store.bytes_of(newest) if newest else None
        except (OSError, ValueError, KeyError, TypeError):  # unreadable or damaged marker (see CheckpointStore.problem)
            return "", None

    def _raise(self, trainer, name: str, error: BaseException | None, described: tuple[str, str] | None,
               everyone: list) -> None:
        """The same outcome on every rank, in order of what the user can act on: a full disk (exit 16, one line),
        an object store that did not answer (exit 17, one line), another storage error (exit 1, one line). A bug is
        raised unchanged, traceback and all, on its rank (``described``: this rank's ``_described``)."""
        failed = [(rank, theirs) for rank, (theirs, *_) in enumerate(everyone) if theirs is not None]
        if described is not None and described[0] == "bug":
            raise error
        here, newest, newest_bytes = everyone[0][1]
        full = next(((rank, text) for rank, (kind, text) in failed if kind == "full"), None)
        if full is not None:
            estimate = (everyone[0][2] if compat.rank_zero_writes(trainer.strategy)
                        else sum(state for *_, state in everyone))
            raise StorageFull(full_message(name, self.store.url, full[1], here, newest_bytes or estimate, newest,
                                           os.environ.get(RUN_ID_ENV), estimated=not newest_bytes)) from error
        if (text := next((text for _, (kind, text) in failed if kind == "unreachable"), None)) is not None:
            if isinstance(error, StoreUnreachable):
                raise error
            raise StoreUnreachable(text) from error
        rank, (kind, text) = next(((r, d) for r, d in failed if d[0] == "storage"), failed[0])
        where = f" on rank {rank}" if trainer.world_size > 1 else ""
        if kind == "storage":
            raise CheckpointError(f"saving checkpoint {name} in {self.store.url} failed{where}: {text}") from error
        raise RuntimeError(f"saving checkpoint {name} failed{where} (its traceback is in that rank's log): {text}")


def _in_background(work: Callable[[], None]) -> Future:
    """``work()`` on a daemon thread of its own. Not a pool's thread: the interpreter joins those at exit, and a
    sharded save's collective waiting for a rank that died would then keep the process alive until it times out.
    Every normal end waits for the save first (``Checkpointing.on_train_end``, ``teardown``)."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(work())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the future
                future.set_exception(exc)

    threading.Thread(target=run, name="lit-dist-save", daemon=True).start()
    return future


def summary(error: BaseException) -> tuple[str, bool]:
    """A save's error in one line for a log (the run ended for another reason, reported in its own line), and
    whether it looks like a bug, whose traceback is worth printing with it. A sharded save's error holds every
    rank's traceback in its text."""
    kind, text = _described(error)
    return text, kind == "bug"


def _described(error: BaseException | None, rank_bytes: int = 0, folder: str | None = None) -> tuple[str, str] | None:
    """(kind, text) of a save's error for the other ranks: "full" (no space, no inodes, over quota: the
    strerror; or a short write while ``folder``'s filesystem has less room than this rank's ``rank_bytes``),
    "unreachable" (an object store outage past its deadline: the whole line), "storage" (another OSError, also
    one held by torch.distributed.checkpoint's CheckpointException, or a short write) or "bug" (anything else)."""
    if error is None:
        return None
    if isinstance(error, StoreUnreachable):
        return "unreachable", str(error)
    if (full := full_error(error)) is not None:
        return "full", os.strerror(full.errno)
    if (short := short_write(error)) is not None:
        here = room(folder) if folder else None
        if here is not None and here.free_bytes < rank_bytes:
            return "full", os.strerror(errno.ENOSPC)
        return "storage", f"a write stopped short ({str(short).splitlines()[0]})"
    if isinstance(error, OSError | CheckpointException) and (found := os_errors(error)):
        return "storage", f"{type(found[0]).__name__}: {found[0]}"
    return "bug", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
