"""The checkpoint folder of a run: one folder per checkpoint, which counts only once its marker exists.

    {dirpath}/
      step-000001200/            one checkpoint
        state.ckpt               Lightning's checkpoint: a file (rank 0 wrote it) or a folder
                                 (sharded strategies: every rank wrote its part)
        COMPLETE.json            the marker, written last: step, epoch, every file with size and sha256
      step-000001500/
      latest                     name of the newest complete checkpoint, written after its marker
      .partial-step-000001800/   being written (local filesystems), renamed to step-... when complete

On an object store there is no rename: objects are uploaded to their final keys, the marker last,
and a folder without a marker is an interrupted save. Every request to the store (an upload, a listing,
a marker read, a deletion) is retried on its own through an outage of the store, up to
``outage_deadline_s`` (``lit_dist.ckpt.files.through_outage``); past it, ``StoreUnreachable`` (exit 17)
names what was being done.
"""

import heapq
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TypeVar

from lit_dist.ckpt.files import (
    FileEntry,
    filesystem,
    fsync_dir,
    hash_file,
    is_local,
    through_outage,
    write_bytes_atomically,
)
from lit_dist.runtime import outage

MARKER = "COMPLETE.json"
STATE = "state.ckpt"
LATEST = "latest"
PREFIX = "step-"
PARTIAL = ".partial-"
TRASH = ".deleting-"
PROBE = ".probe-"  # written by rank 0 at the start, read by every rank: is the folder shared?
FORMAT = 1
_DELETER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit-dist-delete")
log = logging.getLogger(__name__)
T = TypeVar("T")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:09d}"


def share_of(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` verifies: the biggest first, each to the rank with the fewest bytes so
    far (ties to the lowest rank). Every rank computes the same split from the same manifest, and together they
    read the checkpoint once instead of ``world`` times."""
    if world <= 1:
        return list(sizes)
    load = [(0, r) for r in range(world)]  # a heap of (bytes so far, rank)
    mine = []
    for rel in sorted(sizes, key=lambda rel: (-sizes[rel], rel)):
        taken, owner = heapq.heappop(load)
        if owner == rank:
            mine.append(rel)
        heapq.heappush(load, (taken + sizes[rel], owner))
    return mine


class CheckpointStore:
    """Lists, validates, finishes and deletes the checkpoints under ``url`` (local path or fsspec URL)."""

    def __init__(self, url: str, storage_options: dict | None = None, outage_deadline_s: float = outage.DEADLINE_S):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options)
        self.local = is_local(self.fs)
        self.outage_deadline_s = outage_deadline_s
        self.who = ""  # starts the line of an outage ("rank 0: "), once the rank is known
        self._manifests: dict[str, dict] = {}  # complete checkpoints never change (but for their metric)

    def remote(self, operation: Callable[[], T], verb: str, what: str) -> T:
        """``operation()``, retried through an outage of an object store (one idempotent request or upload)."""
        return through_outage(self.fs, operation, verb, what, self.outage_deadline_s, self.who)

    def saving(self, name: str) -> str:
        """What a save of checkpoint ``name`` is, in an outage's message: "step 12 to s3://b/ckpt/step-000000012"."""
        return f"step {int(name[len(PREFIX):])} to {self.url_of(name)}"

    # -- paths --------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """A path on ``self.fs`` below the root."""
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """What Lightning and torch.load are given: a local path, or a URL with its protocol."""
        path = self.path(*parts)
        return path if self.local else self.fs.unstrip_protocol(path)

    def staging(self, name: str) -> str:
        """Where checkpoint ``name`` is written before it is complete."""
        return self.path(PARTIAL + name) if self.local else self.path(name)

    # -- writing (rank 0) ----------------------------------------------------------------------

    def begin(self, name: str) -> None:
        """Make room for checkpoint ``name``: no leftovers of an interrupted save, no stale marker."""
        if self.local:
            self._remove_tree(self.staging(name))
            os.makedirs(self.staging(name), exist_ok=True)
        elif self.remote(lambda: self.fs.exists(self.path(name, MARKER)), "saving", self.saving(name)):
            self.delete(name)  # the same step saved again (a rerun): never mix old and new objects

    def finish(self, name: str, files: dict[str, FileEntry], info: dict) -> dict:
        """Write the marker (after every rank wrote its files), publish the checkpoint, update ``latest``."""
        manifest = {"format": FORMAT, **info, "created": time.time(),
                    "files": {rel: asdict(entry) for rel, entry in sorted(files.items())}}
        staging = self.staging(name)
        self.remote(lambda: self._write_marker(staging, manifest), "saving", f"{self.saving(name)} (its {MARKER})")
        if self.local:
            final = self.path(name)
            if os.path.exists(final):
                self._remove_tree(final)
            os.replace(staging, final)
            fsync_dir(self.root)
        self._manifests[name] = manifest
        self.remote(lambda: write_bytes_atomically(self.fs, self.path(LATEST), (name + "\n").encode()), "saving",
                    f"{self.saving(name)} (the {LATEST} marker)")
        return manifest

    def abandon(self, name: str) -> None:
        """Remove what a failed save of ``name`` left (local filesystems: its staging folder) now, not on a thread:
        after a full disk, the room it took is what the user needs back. Call once no rank writes into it."""
        if not self.local:
            return  # objects at their final keys without a marker: ``clean`` removes them when the next run starts
        try:
            shutil.rmtree(self.staging(name))
        except FileNotFoundError:
            pass  # the save failed before its folder was made
        except OSError as exc:
            log.warning("lit-dist: could not remove %s (%s); the next run removes it when it starts",
                        self.staging(name), exc)

    def bytes_of(self, name: str) -> int:
        """Size of a complete checkpoint's files, from its manifest."""
        return sum(entry["size"] for entry in self.manifest(name)["files"].values())

    def set_metric(self, name: str, metric: dict) -> None:
        """Record a monitored value in a complete checkpoint's marker (rewritten atomically)."""
        manifest = dict(self.manifest(name), metric=metric)
        self.remote(lambda: self._write_marker(self.path(name), manifest), "saving",
                    f"{self.saving(name)} (its {MARKER}, with {metric.get('name')})")
        self._manifests[name] = manifest

    def _write_marker(self, folder: str, manifest: dict) -> None:
        write_bytes_atomically(self.fs, "/".join([folder, MARKER]), json.dumps(manifest, indent=1).encode())

    # -- reading ------------------------------------------------------------------------------

    def _fresh(self) -> bool:
        """Whether the root exists, as other processes left it (object-store listings are cached)."""
        if not self.local:
            self.fs.invalidate_cache()  # listings and object details, which other processes may have changed
        return self.fs.exists(self.root)

    def names(self) -> list[str]:
        """Every checkpoint folder (complete or not), newest first."""
        def listing() -> list[str]:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)] if self._fresh() else []

        found = self.remote(listing, "listing", f"the checkpoints in {self.url}")
        return sorted((n for n in found if n.startswith(PREFIX)), reverse=True)

    def complete(self) -> list[str]:
        """Checkpoints whose marker exists, newest first (not verified)."""
        def markers() -> list[str]:
            return self.fs.glob(self.path(f"{PREFIX}*", MARKER)) if self._fresh() else []

        found = self.remote(markers, "listing", f"the checkpoints in {self.url}")
        return sorted((m.rstrip("/").rsplit("/", 2)[-2] for m in found), reverse=True)

    def manifest(self, name: str) -> dict:
        if name not in self._manifests:
            def read() -> bytes:
                with self.fs.open(self.path(name, MARKER), "rb") as f:
                    return f.read()

            self._manifests[name] = json.loads(self.remote(read, "reading", f"checkpoint {self.url_of(name)}"))
        return self._manifests[name]

    def problem(self, name: str, verify_checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
        """Why checkpoint ``name`` cannot be used, or None if its files match its manifest. With ``share=(rank,
        world)`` only that rank's share of the files is read (``share_of``): the ranks of a run split the work."""
        return self.unusable(name) or self.files_problem(name, verify_checksums, share)

    def unusable(self, name: str) -> str | None:
        """What every rank sees alike, from the marker alone: not finished, unreadable, or marked damaged."""
        self._manifests.pop(name, None)  # read what is on disk now
        if not self.local:
            self.fs.invalidate_cache()
        try:
            manifest = self.manifest(name)
            for entry in manifest["files"].values():
                FileEntry(**entry)
        except FileNotFoundError:
            return f"no {MARKER} (the save did not finish)"
        except (ValueError, KeyError, TypeError) as exc:
            return f"its {MARKER} is unreadable ({exc})"
        if damaged := manifest.get("damaged"):
            return f"marked damaged: {damaged}"
        return None

    def files_problem(self, name: str, verify_checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
        """Whether this rank's share of checkpoint ``name``'s files has the size (and sha256) of its manifest."""
        files = {rel: FileEntry(**entry) for rel, entry in self.manifest(name)["files"].items()}
        files = {rel: files[rel] for rel in share_of({rel: entry.size for rel, entry in files.items()}, *share)}
        reading = f"checkpoint {self.url_of(name)}"
        for rel, expected in files.items():
            path = self.path(name, rel)
            try:
                size = self.remote(lambda path=path: self.fs.size(path), "reading", reading)
            except FileNotFoundError:
                return f"{rel} is missing"
            if size != expected.size:
                return f"{rel} has {size} bytes, the manifest says {expected.size} (truncated or overwritten)"
        if verify_checksums and files:
            with ThreadPoolExecutor(max_workers=min(4, len(files))) as pool:  # hashlib releases the GIL
                hashed = pool.map(lambda rel: self.remote(lambda: hash_file(self.fs, self.path(name, rel)), "reading", reading),
                                  files)
                actual = dict(zip(files, hashed, strict=True))
            for rel, expected in files.items():
                if actual[rel].sha256 != expected.sha256:
                    return f"{rel} does not match its sha256 (corrupted)"
        return None

    def mark_damaged(self, name: str, why: str) -> None:
        """Record in the marker of complete checkpoint ``name`` that it is damaged: every later look skips it
        without reading its files (the ranks of a run that found it each verified only their share)."""
        manifest = dict(self.manifest(name), damaged=why)
        self.remote(lambda: self._write_marker(self.path(name), manifest), "saving",
                    f"{self.url_of(name)} (its {MARKER}, marked damaged)")

    def find_valid(self, verify_checksums: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
        """(the newest usable checkpoint or None, [(name, problem)] of the newer ones that were skipped)."""
        skipped = []
        for name in self.names():
            problem = self.problem(name, verify_checksums)
            if problem is None:
                return name, skipped
            skipped.append((name, problem))
        return None, skipped

    # -- deleting (rank 0) --------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove a checkpoint so that no half-deleted one can pass for complete."""
        self._manifests.pop(name, None)
        if self.local:
            self._remove_tree(self.path(name))
            return
        marker, folder = self.path(name, MARKER), self.path(name)
        # Two requests, each retried alone: repeating either after it worked changes nothing.
        self.remote(lambda: self.fs.exists(marker) and self.fs.rm(marker), "deleting",
                    f"checkpoint {self.url_of(name)}")  # marker first: what remains is visibly incomplete
        self.remote(lambda: self.fs.exists(folder) and self.fs.rm(folder, recursive=True), "deleting",
                    f"checkpoint {self.url_of(name)}")

    def clean(self) -> list[str]:
        """Remove what interrupted saves and deletions left behind; call when nothing is being written."""
        if not self.remote(lambda: self.fs.exists(self.root), "listing", f"the checkpoints in {self.url}"):
            return []
        removed = []
        if self.local:
            for entry in os.listdir(self.root):
                if entry.startswith((PARTIAL, TRASH, PROBE)):
                    path = os.path.join(self.root, entry)
                    if os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
                    removed.append(entry)
                elif entry.startswith(".") and ".tmp-" in entry:
                    os.unlink(os.path.join(self.root, entry))
                    removed.append(entry)
        else:
            for name in sorted(set(self.names()) - set(self.complete())):
                self.delete(name)
                removed.append(name)
        return removed

    def rotate(self, keep_last_n: int, protect: set[str], monitor: str | None = None, mode: str = "min",
               keep_best_k: int = 0) -> list[str]:
        """Delete complete checkpoints beyond the newest ``keep_last_n``, the best ``keep_best_k`` and ``protect``."""
        names = self.complete()
        keep = set(names[:keep_last_n]) | protect
        if monitor and keep_best_k > 0:
            keep |= set(self._ranked(names, monitor, mode)[:keep_best_k])
        deleted = [name for name in names if name not in keep]
        for name in deleted:
            self.delete(name)
        return deleted

    def best(self, monitor: str, mode: str = "min") -> str | None:
        """The complete checkpoint with the best recorded ``monitor`` value."""
        ranked = self._ranked(self.complete(), monitor, mode)
        return ranked[0] if ranked else None

    def _ranked(self, names: list[str], monitor: str, mode: str) -> list[str]:
        """The checkpoints among ``names`` with a recorded ``monitor`` value, best first."""
        scored = []
        for name in names:
            metric = self.manifest(name).get("metric") or {}
            if metric.get("name") == monitor and metric.get("value") is not None:
                scored.append((metric["value"] if mode == "min" else -metric["value"], name))
        return [name for _, name in sorted(scored)]

    @staticmethod
    def wait_for_deletions() -> None:
        """Block until the folders handed to the deletion thread are gone."""
        _DELETER.submit(lambda: None).result()

    def _remove_tree(self, path: str) -> None:
        """Rename first: the folder leaves its name at once. The deletion itself (a tenth of a second
        per GB) runs on a thread; what a kill interrupts, ``clean`` removes at the next start."""
        if not os.path.exists(path):
            return
        trash = os.path.join(os.path.dirname(path), f"{TRASH}{os.path.basename(path)}-{uuid.uuid4().hex[:6]}")
        os.replace(path, trash)
        _DELETER.submit(shutil.rmtree, trash, ignore_errors=True)
