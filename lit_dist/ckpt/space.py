"""Room for checkpoints: what a save that did not fit says, and the warning before it happens.

A full disk is the one checkpoint failure a user fixes without reading code: free space, or move the
run directory, then resume. So it gets its own exit code (``ExitCode.STORAGE_FULL``) and one line with
what is needed to act: which folder, the filesystem it is on, what is free there, the size of a
checkpoint, the newest complete checkpoint and how to resume from it. The warning comes earlier, after
a save, when fewer than two more checkpoints fit (rotation deletes an old one only after the new one is
complete, so a run needs room for one more than it keeps).
"""

import errno
import os
from dataclasses import dataclass

import torch

from lit_dist.errors import StorageFull

# Out of blocks or inodes (ENOSPC), or over the user's quota (EDQUOT): more room is the fix for all three.
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def size_text(n: float) -> str:
    """``n`` bytes for a person: 322 KB, 1.4 GB (powers of 1000, like the other sizes lit-dist prints)."""
    unit = "bytes"
    for larger in ("KB", "MB", "GB", "TB"):
        if n < 1000:
            break
        n, unit = n / 1000, larger
    return f"{n:.0f} {unit}" if unit in ("bytes", "KB") or n >= 100 else f"{n:.1f} {unit}"


def _chain(exc: BaseException | None):
    """``exc``, its causes and contexts, and the per-rank failures of a ``torch.distributed.checkpoint``
    ``CheckpointException`` (how a sharded save reports a rank's write), each once."""
    todo, seen = [exc], set()
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():  # (exception, traceback summary) per rank
                todo.append(failure[0] if isinstance(failure, tuple) else failure)


def os_errors(exc: BaseException | None) -> list[OSError]:
    """The OSErrors in ``exc``'s chain (see ``_chain``)."""
    return [e for e in _chain(exc) if isinstance(e, OSError)]


def full_error(exc: BaseException | None) -> OSError | None:
    """The 'no space' / 'quota exceeded' error that ``exc`` is or holds, else None."""
    return next((e for e in os_errors(exc) if e.errno in FULL_ERRNOS), None)


def storage_full(exc: BaseException | None, who: str = "") -> StorageFull | None:
    """A StorageFull naming what did not fit, for a no-space or quota error anywhere in ``exc``'s chain that no
    component turned into its own line (a journal, a cache, an index, an export): the fix is the same, more room.
    ``who``: the line's start, e.g. "rank 1: " in a run of several processes."""
    if (full := full_error(exc)) is None:
        return None
    what = full.filename if isinstance(full.filename, str) else None
    where = f" writing {what} ({room_text(room(os.path.dirname(what) or '.'))})" if what else " (the error names no file)"
    return StorageFull(f"{who}{os.strerror(full.errno)}{where}. Free space there or write elsewhere, then run the "
                       "same command again (a training run resumes from its newest complete checkpoint)")


def short_write(exc: BaseException | None) -> RuntimeError | None:
    """torch's zip writer's error for a write that stored fewer bytes than it was given ("unexpected pos"), in
    ``exc``'s chain, else None. A full disk makes it: the OSError it follows is its ``__context__`` only on the
    rank that wrote; ``torch.distributed.checkpoint`` pickles a rank's failure for every rank, which drops it."""
    return next((e for e in _chain(exc) if isinstance(e, RuntimeError) and "unexpected pos" in str(e)), None)


def state_bytes(checkpoint: dict) -> int:
    """Bytes of the tensors in a checkpoint dict held by this rank (a shard's local part for DTensors): what a
    checkpoint will take, to say before the first one is complete."""
    total = 0

    def visit(value) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(checkpoint)
    return total


@dataclass(frozen=True)
class Room:
    """Free space of the filesystem a folder is on."""

    mount: str  # where that filesystem is mounted
    free_bytes: int  # for an unprivileged user
    free_inodes: int | None  # None where the filesystem does not count them


def room(path: str) -> Room | None:
    """The room on the filesystem of ``path`` (its nearest existing folder); None where it cannot be asked."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path or ".")
    except OSError:
        return None
    mount = os.path.abspath(path or ".")
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    return Room(mount, stat.f_bavail * stat.f_frsize, stat.f_favail if stat.f_files else None)


def room_text(here: Room | None, inodes: bool = False) -> str:
    """'the filesystem at /scratch has 136 KB free' (and its free inodes when ``inodes`` or none are left)."""
    if here is None:
        return "its free space is unknown"
    text = f"the filesystem at {here.mount} has {size_text(here.free_bytes)} free"
    if here.free_inodes == 0:
        return text + " and no free inodes (files)"
    return text + f" and {here.free_inodes} free inodes (files)" if inodes and here.free_inodes is not None else text


def _inodes_per_checkpoint(files: int) -> int:
    return files + 3  # and its folder, its marker, a sharded state's folder


def too_little(here: Room | None, checkpoint_bytes: int, checkpoint_files: int) -> bool:
    """Whether fewer than two more checkpoints of this size (and number of files) fit in ``here``."""
    if here is None:
        return False
    return here.free_bytes < 2 * checkpoint_bytes or _few_inodes(here, checkpoint_files)


def _few_inodes(here: Room, checkpoint_files: int) -> bool:
    return here.free_inodes is not None and here.free_inodes < 2 * _inodes_per_checkpoint(checkpoint_files)


def low_room_warning(folder: str, here: Room, checkpoint_bytes: int, checkpoint_files: int) -> str:
    """The one line said when fewer than two more checkpoints fit."""
    return (f"lit-dist: {folder} is running out of room: {room_text(here, _few_inodes(here, checkpoint_files))}, less "
            f"than two checkpoints of {size_text(checkpoint_bytes)}. Free space there or move the run directory now: "
            "a save that does not fit ends the run (exit 16)")


def full_message(name: str, folder: str, reason: str, here: Room | None, checkpoint_bytes: int | None,
                 newest: str | None, run_id: str | None, estimated: bool = False) -> str:
    """The one line of a save that did not fit (``reason``: the strerror; ``newest``: the newest complete
    checkpoint, None if there is none, "" if the folder could not be listed; ``estimated``: the size is that of
    the state in memory, not of a complete checkpoint)."""
    about = "about " if estimated else ""
    size = f"a checkpoint takes {about}{size_text(checkpoint_bytes)}" if checkpoint_bytes else "a checkpoint's size is unknown"
    if newest:
        latest, resume = f"the newest complete checkpoint is {newest}", f"it resumes from {newest}"
    elif newest is None:
        latest, resume = "no checkpoint is complete yet", "it starts from the beginning"
    else:
        latest, resume = "its checkpoints could not be listed", "it resumes from the newest usable checkpoint"
    again = f"the same command with --run.run_id {run_id}" if run_id else "the same command"
    return (f"checkpoint {name} does not fit in {folder} ({reason}): {room_text(here)}, {size}; {latest}. Free "
            f"space there, or copy the run directory to a bigger disk and point --run.root_dir (or "
            f"checkpoint.dirpath) at the copy; then run {again}: {resume}")
