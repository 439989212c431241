"""A cache folder: complete shards listed in a manifest, or nothing.

    {dir}/
      CACHE.json                       marks a lit-dist cache (format version)
      pixels/                          one folder per field (pixels, encoder)
        manifest.json                  published shards: name, fingerprint, bytes, sha256, samples, index file
        configs.json                   fingerprint -> what it stands for (to name another configuration)
        shards/<id>.arrow              samples (see shards.py)
        shards/<id>.index.arrow        their index
        pending/<build>-rank<r>.json   shards a rank finished in a build not yet published

A shard counts only once it is listed with its sha256: each file is written with
lit-dist's atomic writer (temporary name in the same folder, fsync, rename; on S3 the
object appears whole), then the rank's pending list is rewritten to name it, and rank 0
folds the pending lists into the manifest when every rank is done. A build that was killed
leaves pending lists of complete shards (kept: the next build does not redo them) and
perhaps unlisted files (torn or never listed: removed, never read).
"""

import json
import os
import time
import uuid

from lit_dist.ckpt.files import filesystem, hash_file, is_local, write_bytes_atomically
from lit_dist.errors import ConfigError, DataError

# 2: shards whose manifest entries say how their values are stored ("values", "layout"; cache/shards.py),
# which a reader of format 1 would take for damaged entries. 3: the "row_tree" layout, whose entries a
# reader of format 2 would serve as pixels. Caches of older formats read as they always did.
FORMAT = 3
MARKER = "CACHE.json"
KIND = "lit-dist cache"


class CacheStore:
    """One cache folder, local or on an object store."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = filesystem(self.url, storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"data.cache.dir = {url!r}: cannot open it ({exc})") from exc
        self.local = is_local(self.fs)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def refresh(self) -> None:
        """Forget cached listings: other processes write here."""
        if not self.local:
            self.fs.invalidate_cache()

    # -- the marker ---------------------------------------------------------------------------

    def check(self, create: bool = False) -> bool:
        """Whether this is a lit-dist cache (creating it when ``create``); a clear error when it is something else."""
        self.refresh()
        try:
            if self.fs.exists(self.path(MARKER)):
                with self.fs.open(self.path(MARKER), "rb") as f:
                    marker = json.loads(f.read())
                if marker.get("kind") != KIND:
                    raise DataError(f"data.cache.dir = {self.url!r}: {MARKER} there is not a lit-dist cache marker; "
                                    "point data.cache.dir at another folder")
                if int(marker.get("format", 0)) > FORMAT:
                    raise DataError(f"data.cache.dir = {self.url!r} was written by a newer lit-dist (cache format "
                                    f"{marker['format']}, this one reads up to {FORMAT}): upgrade lit-dist, or use "
                                    "another data.cache.dir")
                return True
            if self.fs.exists(self.root) and self.fs.ls(self.root, detail=False):
                raise DataError(f"data.cache.dir = {self.url!r} is a folder with other files in it and no {MARKER}: "
                                "it is not a lit-dist cache. Point data.cache.dir at an empty or new folder.")
            if create:
                write_bytes_atomically(self.fs, self.path(MARKER),
                                       json.dumps({"kind": KIND, "format": FORMAT, "created": time.time()}).encode())
                return True
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"data.cache.dir = {self.url!r}: its {MARKER} is unreadable ({exc})") from exc
        except OSError as exc:  # permissions, a file where a folder should be, an unreachable store
            raise ConfigError(f"data.cache.dir = {self.url!r}: this process cannot {'create' if create else 'read'} "
                              f"it ({exc}). Give this user read (and for building, write) access, or choose another "
                              "folder.") from exc
        return False

    def check_writable(self) -> None:
        """Fail early, with the path, when this process cannot write into the cache."""
        probe = self.path(f".probe-{uuid.uuid4().hex[:8]}")
        try:
            write_bytes_atomically(self.fs, probe, b"probe")
            self.fs.rm(probe)
        except OSError as exc:
            raise ConfigError(f"data.cache.dir = {self.url!r}: this process cannot write there ({exc}). Build the "
                              "cache where every rank can write (a shared filesystem or an object store), or fix "
                              "its permissions.") from exc

    # -- manifests ----------------------------------------------------------------------------

    def _read_json(self, *parts: str, default=None):
        path = self.path(*parts)
        if not self.fs.exists(path):
            return default
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())

    def manifest(self, field: str) -> dict:
        """The published shards of ``field``: {"format", "shards": [...]}."""
        self.refresh()
        manifest = self._read_json(field, "manifest.json", default={"format": FORMAT, "shards": []})
        if int(manifest.get("format", 0)) > FORMAT:
            raise DataError(f"{self.url}/{field}/manifest.json has format {manifest['format']}, newer than this "
                            f"lit-dist reads ({FORMAT}): upgrade lit-dist")
        return manifest

    def configs(self, field: str) -> dict:
        return self._read_json(field, "configs.json", default={})

    def _write_json(self, obj, *parts: str) -> None:
        write_bytes_atomically(self.fs, self.path(*parts), json.dumps(obj, indent=1).encode())

    def record_config(self, field: str, fingerprint: str, description: dict) -> None:
        configs = self.configs(field)
        if fingerprint not in configs:
            configs[fingerprint] = description
            self._write_json(configs, field, "configs.json")

    # -- writing (every rank) -------------------------------------------------------------------

    def write_shard(self, field: str, fingerprint: str, data: bytes, index: bytes, raw_bytes: int, samples: int,
                    entries: int, encoding: dict | None = None) -> dict:
        """Write one shard and its index (complete or absent); returns its manifest entry (``encoding``: how its
        values are stored, ``ShardWriter.encoding``)."""
        name = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:12]}"
        shard = write_bytes_atomically(self.fs, self.path(field, "shards", f"{name}.arrow"), data)
        listed = write_bytes_atomically(self.fs, self.path(field, "shards", f"{name}.index.arrow"), index)
        return {"name": name, "fingerprint": fingerprint, "bytes": shard.size, "sha256": shard.sha256,
                "raw_bytes": raw_bytes, "samples": samples, "entries": entries,
                "index_bytes": listed.size, "index_sha256": listed.sha256, **(encoding or {})}

    def record_pending(self, field: str, build: str, rank: int, shards: list[dict]) -> None:
        """Name a rank's finished shards (rewritten whole after each shard): they survive a kill of the build."""
        self._write_json({"format": FORMAT, "shards": shards}, field, "pending", f"{build}-rank{rank}.json")

    # -- publishing (rank 0, while no rank writes) ----------------------------------------------

    def publish(self, field: str, drop: set[str] = frozenset()) -> dict:
        """Fold every pending list into the manifest (dropping the shards named in ``drop``), then remove the
        lists and every shard file the manifest does not name. Returns the new manifest."""
        manifest = self.manifest(field)
        listed = {s["name"]: s for s in manifest["shards"]}
        pending = self._pending(field)
        for path in pending:
            try:
                for shard in self._read_pending(path):
                    if shard["name"] not in listed and self._present(field, shard):
                        listed[shard["name"]] = shard
            except (ValueError, KeyError, TypeError):
                pass  # a pending list is rewritten atomically; an unreadable one names nothing to trust
        shards = [s for name, s in sorted(listed.items()) if name not in drop]
        manifest = {"format": FORMAT, "updated": time.time(), "shards": shards}
        self._write_json(manifest, field, "manifest.json")  # the manifest first: then the lists are redundant
        for path in pending:
            self.fs.rm(path)
        self.clean(field, {s["name"] for s in shards})
        return manifest

    def _pending(self, field: str) -> list[str]:
        self.refresh()
        folder = self.path(field, "pending")
        return sorted(p for p in self.fs.ls(folder, detail=False) if p.endswith(".json")) if self.fs.exists(folder) else []

    def _read_pending(self, path: str) -> list[dict]:
        with self.fs.open(path, "rb") as f:
            return json.loads(f.read())["shards"]

    def _present(self, field: str, shard: dict) -> bool:
        """Whether a listed shard's two files exist with their recorded sizes."""
        try:
            return (self.fs.size(self.path(field, "shards", f"{shard['name']}.arrow")) == shard["bytes"]
                    and self.fs.size(self.path(field, "shards", f"{shard['name']}.index.arrow")) == shard["index_bytes"])
        except FileNotFoundError:
            return False

    def clean(self, field: str, keep: set[str]) -> list[str]:
        """Remove shard files no manifest names: torn writes, temporary files, shards of a build cut off
        before it listed them, and dropped shards."""
        folder = self.path(field, "shards")
        self.refresh()
        if not self.fs.exists(folder):
            return []
        removed = []
        for path in self.fs.ls(folder, detail=False):
            base = path.rstrip("/").rsplit("/", 1)[-1]
            name = base.removesuffix(".index.arrow").removesuffix(".arrow")
            if name not in keep or base.startswith("."):
                self.fs.rm(path)
                removed.append(base)
        return removed

    # -- reading ----------------------------------------------------------------------------

    def shard_url(self, field: str, name: str) -> str:
        path = self.path(field, "shards", f"{name}.arrow")
        return path if self.local else self.fs.unstrip_protocol(path)

    def read_index(self, field: str, shard: dict) -> bytes:
        """A shard's index file, checked against its sha256."""
        import hashlib

        with self.fs.open(self.path(field, "shards", f"{shard['name']}.index.arrow"), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != shard["index_sha256"]:
            raise ValueError("index does not match its sha256")
        return data

    def shard_problem(self, field: str, shard: dict, verify_checksum: bool) -> str | None:
        """Why a listed shard cannot be used, or None."""
        path = self.path(field, "shards", f"{shard['name']}.arrow")
        try:
            size = self.fs.size(path)
        except FileNotFoundError:
            return "missing"
        if size != shard["bytes"]:
            return f"{size} bytes, the manifest says {shard['bytes']} (truncated or overwritten)"
        if verify_checksum and hash_file(self.fs, path).sha256 != shard["sha256"]:
            return "does not match its sha256 (corrupted)"
        return None

    def size_summary(self, field: str) -> str:
        """``N shards, X MB, compression Rx`` of a field's published shards, from the manifest alone."""
        shards = self.manifest(field)["shards"]
        stored, raw = sum(s["bytes"] for s in shards), sum(s["raw_bytes"] for s in shards)
        ratio = f", compression {raw / stored:.2f}x" if stored else ""
        return f"{len(shards)} shards, {stored / 1e6:.1f} MB{ratio}"

    def bytes_on_disk(self) -> int:
        self.refresh()
        if not self.fs.exists(self.root):
            return 0
        return sum(int(info.get("size") or 0) for info in self.fs.find(self.root, detail=True).values())


def new_build_id() -> str:
    return f"{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
