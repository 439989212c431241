"""Before any image is decoded: are the table's files where the dataset root says they are?

A wrong ``data.root`` (the images one folder deeper than the table, say) would otherwise start the
run, pay its start-up, and fail in a loader worker once a batch found nothing but missing files. A
few dozen files spread over the rows are looked up instead (a stat each on a local disk, concurrent
HEAD requests on an object store), and when most are missing the folders one level down and one
level up are searched for them, so the message can say where they are.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lit_dist.errors import DataError
from lit_dist.runtime import outage

SAMPLE = 32  # files looked up: with a few bad rows among them the run goes on (they are replaced and counted)
_NEARBY = 200  # at most this many sibling folders are searched


def check_files_exist(root: str, filenames, rows: np.ndarray, field: str, storage_options: dict | None = None,
                      how_set: str = "", sample: int = SAMPLE) -> None:
    """Raise a DataError naming ``field`` (the config field that gives ``root``; ``how_set``: e.g. that it is
    unset) when more than half of a sample of the files of ``rows`` (positions into ``filenames``, a pyarrow
    string array) are not under ``root``."""

    if not len(rows):
        return
    picks = np.unique(rows[np.linspace(0, len(rows) - 1, min(sample, len(rows))).astype(np.int64)])
    names = [filenames[int(i)].as_py() for i in picks]
    fs, base = outage.url_to_fs(root, **(storage_options or {}))
    base = base.rstrip("/")
    missing = [n for n, there in zip(names, _exist(fs, [f"{base}/{n}" for n in names]), strict=True) if not there]
    if len(missing) * 2 <= len(names):  # a few missing files are bad samples: replaced, counted, reported
        return
    found = _nearby(fs, base, missing[:3])
    if found is not None:
        folder, how = _shown(fs, found[0]), found[1]
        hint = f"they are in {folder!r} ({how}): set {field}: {folder}"
    else:
        hint = f"nor are they one folder down or up: check {field} against the table's filename column (paths under it)"
    example = _shown(fs, f"{base}/{missing[0]}")
    raise DataError(f"{field} = {root!r}{how_set}: {len(missing)} of {len(names)} files sampled from the table are "
                    f"not there (e.g. {example}); {hint}")


def mtime(info: dict) -> float:
    """A file's modification time (seconds since the epoch) from an fsspec listing entry: local, S3 or GCS spelling."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0)))
    return value.timestamp() if hasattr(value, "timestamp") else float(value or 0)


def _shown(fs, path: str) -> str:
    """A path as the user writes it: as it is locally, as a URL on an object store."""
    from lit_dist.ckpt.files import is_local

    return path if is_local(fs) else fs.unstrip_protocol(path)


def _exist(fs, paths: list[str]) -> list[bool]:
    from lit_dist.ckpt.files import is_local

    if is_local(fs):
        return [fs.exists(p) for p in paths]
    with ThreadPoolExecutor(16) as pool:  # an object store: one round trip for all of them, not one each
        return list(pool.map(fs.exists, paths))


def _nearby(fs, base: str, names: list[str]) -> tuple[str, str] | None:
    """(folder, "one folder down" / "one folder up") that holds every one of ``names``, or None."""
    parent = base.rsplit("/", 1)[0] if "/" in base.strip("/") else None
    candidates = [(parent, "one folder up")] if parent else []
    try:
        below = sorted(info["name"].rstrip("/") for info in fs.ls(base, detail=True) if info.get("type") == "directory")
    except (FileNotFoundError, NotADirectoryError):
        below = []
    candidates += [(folder, "one folder down") for folder in below[:_NEARBY]]
    for folder, how in candidates:
        if all(_exist(fs, [f"{folder}/{n}" for n in names])):
            return folder, how
    return None
