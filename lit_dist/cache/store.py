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

Damaged files. Each index file carries its shard's manifest entry (``shards.described_index``),
so a manifest that is unreadable, truncated, empty or gone while shards remain is rebuilt from
the index files (with a warning; a build writes it back), and so are the shards of a damaged
pending list. A damaged or missing ``CACHE.json`` in a folder that holds only a cache's fields is
written again. A damaged ``configs.json`` only loses the names of older configurations. A shard
or index file that is missing, of the wrong size or unreadable makes its shard damaged: its
samples count as missing (mode read refuses to start), and a build drops it and rebuilds them.
"""

import hashlib
import json
import os
import time
import uuid

from lightning.pytorch.utilities import rank_zero_warn

from lit_dist.cache.shards import described_index, index_description, read_index
from lit_dist.ckpt.files import filesystem, hash_file, is_local, write_bytes_atomically
from lit_dist.errors import ConfigError, DataError

# 2: shards whose manifest entries say how their values are stored ("values", "layout"; cache/shards.py),
# which a reader of format 1 would take for damaged entries. 3: the "row_tree" layout, whose entries a
# reader of format 2 would serve as pixels. Caches of older formats read as they always did.
FORMAT = 3
MARKER = "CACHE.json"
KIND = "lit-dist cache"
FIELDS = ("pixels", "encoder", "caption_encoder")  # the folders a cache holds (CacheConfig.fields)
ENTRY_KEYS = ("name", "fingerprint", "bytes", "sha256", "raw_bytes", "samples", "entries", "index_bytes", "index_sha256")


class CacheStore:
    """One cache folder, local or on an object store."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = filesystem(self.url, storage_options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"data.cache.dir = {url!r}: cannot open it ({exc})") from exc
        self.local = is_local(self.fs)
        self._recovered: dict[str, tuple[str, dict]] = {}  # field -> (what was wrong, the manifest rebuilt)
        self._warned: set[str] = set()  # problems already told, once per store

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
                try:
                    with self.fs.open(self.path(MARKER), "rb") as f:
                        marker = json.loads(f.read())
                except ValueError as exc:  # truncated, empty, not text
                    return self._lost_marker(f"is damaged ({exc})", create)
                if not isinstance(marker, dict):
                    return self._lost_marker("is damaged (not a JSON object)", create)
                if marker.get("kind") != KIND:
                    raise DataError(f"data.cache.dir = {self.url!r}: {MARKER} there is not a lit-dist cache marker; "
                                    "point data.cache.dir at another folder")
                if int(marker.get("format", 0)) > FORMAT:
                    raise DataError(f"data.cache.dir = {self.url!r} was written by a newer lit-dist (cache format "
                                    f"{marker['format']}, this one reads up to {FORMAT}): upgrade lit-dist, or use "
                                    "another data.cache.dir")
                return True
            if self.fs.exists(self.root) and self.fs.ls(self.root, detail=False):
                if self._holds_fields():
                    return self._lost_marker("is missing", create)
                raise DataError(f"data.cache.dir = {self.url!r} is a folder with other files in it and no {MARKER}: "
                                "it is not a lit-dist cache. Point data.cache.dir at an empty or new folder.")
            if create:
                write_bytes_atomically(self.fs, self.path(MARKER),
                                       json.dumps({"kind": KIND, "format": FORMAT, "created": time.time()}).encode())
                return True
        except OSError as exc:  # permissions, a file where a folder should be, an unreachable store
            raise ConfigError(f"data.cache.dir = {self.url!r}: this process cannot {'create' if create else 'read'} "
                              f"it ({exc}). Give this user read (and for building, write) access, or choose another "
                              "folder.") from exc
        return False

    def _holds_fields(self) -> bool:
        """Whether the folder holds a lit-dist cache's fields and nothing else (bar its marker and temporary files):
        its marker was lost or damaged, it is not some other folder."""
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        fields = [n for n in names if n in FIELDS]
        return (bool(fields) and all(n in (*FIELDS, MARKER) or n.startswith(".") for n in names)
                and any(self.fs.exists(self.path(f, "manifest.json")) or self.fs.exists(self.path(f, "shards"))
                        for f in fields))

    def _lost_marker(self, problem: str, create: bool) -> bool:
        """A cache whose marker is damaged or gone: written again by a build, taken as it is by readers."""
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        if not self._holds_fields() and any(n != MARKER and not n.startswith(".") for n in names):
            raise DataError(f"data.cache.dir = {self.url!r}: its {MARKER} {problem}, and the folder holds other files "
                            "than a lit-dist cache's: point data.cache.dir at an empty or new folder")
        if create:
            write_bytes_atomically(self.fs, self.path(MARKER),
                                   json.dumps({"kind": KIND, "format": FORMAT, "created": time.time()}).encode())
        self._warn(f"lit-dist: {self.url}/{MARKER} {problem}, but the folder holds a lit-dist cache's fields only: "
                   + ("written again" if create else "read as a cache (lit-dist cache writes the marker again)"))
        return True

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message)

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
        """The published shards of ``field``: {"format", "shards": [...]}. A manifest that is damaged, or missing
        while shards remain, is rebuilt from the shards' index files (see the module docstring)."""
        self.refresh()
        try:
            manifest = self._read_json(field, "manifest.json")
            problem = _manifest_problem(manifest) if manifest is not None else None
        except ValueError as exc:  # truncated, empty, not text
            manifest, problem = None, f"is damaged ({exc})"
        if manifest is None and problem is None:
            if not self._index_files(field):
                return {"format": FORMAT, "shards": []}  # a new cache
            problem = "is missing"
        if problem is not None:
            return self._rebuilt(field, problem)
        if int(manifest.get("format", 0)) > FORMAT:
            raise DataError(f"{self.url}/{field}/manifest.json has format {manifest['format']}, newer than this "
                            f"lit-dist reads ({FORMAT}): upgrade lit-dist")
        return manifest

    def _rebuilt(self, field: str, problem: str) -> dict:
        """The manifest of ``field`` rebuilt from its index files, made (and told) once per store."""
        if self._recovered.get(field, (None,))[0] != problem:
            shards, lost = self.described_shards(field)
            self._recovered[field] = problem, {"format": FORMAT, "shards": shards}
            samples = sum(s["samples"] for s in shards)
            self._warn(f"lit-dist: {self.url}/{field}/manifest.json {problem}: rebuilt from the index files beside its "
                       f"shards, which describe them ({len(shards)} shards, {samples} samples"
                       + (f"; {len(lost)} shards without a readable description are rebuilt" if lost else "")
                       + "); lit-dist cache writes it back")
        return self._recovered[field][1]

    def _index_files(self, field: str) -> list[str]:
        """The names of the index files in ``field``'s shard folder."""
        folder = self.path(field, "shards")
        if not self.fs.exists(folder):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False))
        return sorted(n for n in names if n.endswith(".index.arrow") and not n.startswith("."))

    def described_shards(self, field: str) -> tuple[list[dict], list[str]]:
        """Manifest entries of the shards in ``field``'s folder whose index files describe them and whose two files
        are whole (sizes as described), and the names of the other shards (written before index files carried a
        description, or damaged: never trusted)."""
        sizes = self.file_sizes(field)
        shards, lost = [], []
        for base in self._index_files(field):
            name = base.removesuffix(".index.arrow")
            try:
                with self.fs.open(self.path(field, "shards", base), "rb") as f:
                    data = f.read()
                entry = index_description(read_index(data))
            except (FileNotFoundError, ValueError):  # gone meanwhile, or not an index (pyarrow's errors are ValueErrors)
                entry = None
            if (entry is None or entry.get("name") != name or any(k not in entry for k in ENTRY_KEYS[:7])
                    or sizes.get(f"{name}.arrow") != entry["bytes"]):
                lost.append(name)
                continue
            shards.append({**entry, "index_bytes": len(data), "index_sha256": hashlib.sha256(data).hexdigest()})
        return shards, lost

    def file_sizes(self, field: str) -> dict[str, int]:
        """{file name: bytes} of ``field``'s shard folder, from one listing."""
        folder = self.path(field, "shards")
        if not self.fs.exists(folder):
            return {}
        return {info["name"].rstrip("/").rsplit("/", 1)[-1]: int(info.get("size") or 0)
                for info in self.fs.ls(folder, detail=True)}

    def configs(self, field: str) -> dict:
        """{fingerprint: description} of the configurations entries were built for; {} when missing or damaged
        (only the naming of older configurations is lost: the next build writes today's again)."""
        try:
            configs = self._read_json(field, "configs.json", default={})
            if isinstance(configs, dict):
                return configs
            problem = "not a JSON object"
        except ValueError as exc:
            problem = str(exc)
        self._warn(f"lit-dist: {self.url}/{field}/configs.json is damaged ({problem}): the configurations older "
                   "entries were built for can no longer be named; the next build writes it again")
        return {}

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
        # Through the page cache, unlike a checkpoint's files: every rank reads the shards in the next epoch.
        shard = write_bytes_atomically(self.fs, self.path(field, "shards", f"{name}.arrow"), data, through_cache=True)
        entry = {"name": name, "fingerprint": fingerprint, "bytes": shard.size, "sha256": shard.sha256,
                 "raw_bytes": raw_bytes, "samples": samples, "entries": entries, **(encoding or {})}
        # The index carries the entry: the shard describes itself if the manifest is ever lost.
        listed = write_bytes_atomically(self.fs, self.path(field, "shards", f"{name}.index.arrow"),
                                        described_index(index, entry), through_cache=True)
        return {**entry, "index_bytes": listed.size, "index_sha256": listed.sha256}

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
        damaged = []
        for path in pending:
            try:
                for shard in self._read_pending(path):
                    if shard["name"] not in listed and self._present(field, shard):
                        listed[shard["name"]] = shard
            except (ValueError, KeyError, TypeError) as exc:  # truncated, empty, not a list of entries
                damaged.append(f"{path.rstrip('/').rsplit('/', 1)[-1]} ({exc})")
        if damaged:  # the shards it named describe themselves: taken from their index files, not rebuilt
            found = [s for s in self.described_shards(field)[0] if s["name"] not in listed]
            listed.update((s["name"], s) for s in found)
            self._warn(f"lit-dist: {self.url}/{field}/pending: damaged list(s) of an interrupted build: "
                       f"{'; '.join(damaged)}; {len(found)} unlisted shards taken from their index files instead")
        shards = [s for name, s in sorted(listed.items()) if name not in drop]
        manifest = {"format": FORMAT, "updated": time.time(), "shards": shards}
        self._write_json(manifest, field, "manifest.json")  # the manifest first: then the lists are redundant
        self._recovered.pop(field, None)
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
            shards = json.loads(f.read())["shards"]
        if not isinstance(shards, list) or any(not isinstance(s, dict) for s in shards):
            raise TypeError("not a list of shard entries")
        return shards

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

    def shard_problem(self, field: str, shard: dict, verify_checksum: bool, sizes: dict | None = None) -> str | None:
        """Why a listed shard (its data or its index file) cannot be used, or None. ``sizes``: the shard folder's
        ``file_sizes``, to look up instead of asking for each file's size."""
        for suffix, size_key, sha_key, what in ((".arrow", "bytes", "sha256", ""),
                                                (".index.arrow", "index_bytes", "index_sha256", "its index file ")):
            path = self.path(field, "shards", f"{shard['name']}{suffix}")
            try:
                size = sizes[f"{shard['name']}{suffix}"] if sizes is not None else self.fs.size(path)
            except (FileNotFoundError, KeyError):
                return f"{what}missing"
            if size != shard[size_key]:
                return f"{what}{size} bytes, the manifest says {shard[size_key]} (truncated or overwritten)"
            if verify_checksum and hash_file(self.fs, path).sha256 != shard[sha_key]:
                return f"{what}does not match its sha256 (corrupted)"
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


def _manifest_problem(manifest) -> str | None:
    """What makes a parsed manifest unusable (a file cut at a point where it still parses), or None."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        return "is damaged (not a manifest: no list of shards)"
    for shard in manifest["shards"]:
        if not isinstance(shard, dict) or any(k not in shard for k in ENTRY_KEYS):
            lacking = ", ".join(k for k in ENTRY_KEYS if k not in shard) if isinstance(shard, dict) else "every key"
            return f"is damaged (an entry lacks {lacking})"
    return None


def new_build_id() -> str:
    return f"{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
