"""A real small filesystem for tests of a full disk: a tmpfs of a given size (and number of inodes) mounted in
a test's folder, unmounted when the test ends. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test is
skipped with the reason, since nothing else runs out of space the way a disk does (``ulimit -f`` gives EFBIG,
not ENOSPC, and a loop-mounted image needs root too)."""

import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from lit_dist.ckpt.store import checkpoint_name
from lit_dist.errors import ExitCode

# The quickstart saving every 2 steps, 10 steps in all: its checkpoints are about 322 KB (one file), 498 KB (FSDP2's
# shards on 2 ranks).
RUN = {"run__run_id": "full", "trainer__max_steps": 10, "checkpoint__every_n_steps": 2,
       "trainer__limit_val_batches": 0, "trainer__num_sanity_val_steps": 0, "trainer__enable_progress_bar": False,
       "data__num_workers": 0, "data__batch_size_per_device": 8}


@contextmanager
def tmpfs(path: Path, size_kb: int, inodes: int | None = None, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size_kb`` KiB (and at most ``inodes`` files and folders, its root included) at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kb}k" + (f",nr_inodes={inodes}" if inodes else "") + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)  # still open somewhere: detach it now


def mounter(folder: Path) -> Iterator[Callable[..., Path]]:
    """The body of a ``small_fs`` fixture: yields ``mount(name, size_kb, inodes=None)``, which mounts a tmpfs at
    ``folder / name``; unmounts them all at the end."""
    with ExitStack() as stack:
        yield lambda name, size_kb, inodes=None: stack.enter_context(tmpfs(folder / name, size_kb, inodes))


def check_ended_full(out, checkpoints: Path, failed: int, newest: int, ranks: int = 1) -> str:
    """The run ended with exit 16, one line per rank (the same) saying it all, its complete checkpoints kept and
    nothing half-written left in ``checkpoints``; returns the line."""
    assert out.returncode == ExitCode.STORAGE_FULL, out.stderr[-4000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == ranks and len(set(errors)) == 1, (errors, out.stderr[-3000:])
    line = errors[0]
    assert re.search(r"has [\d.]+ (bytes|KB|MB) free.*, a checkpoint takes [\d.]+ KB;", line), line
    for fact in (f"checkpoint {checkpoint_name(failed)} does not fit in {checkpoints}", "No space left on device", f"the newest complete checkpoint is {checkpoint_name(newest)}",
                 "--run.run_id full", f"it resumes from {checkpoint_name(newest)}"):
        assert fact in line, line
    assert "Traceback" not in out.stderr, out.stderr[-4000:]
    complete = [checkpoint_name(step) for step in range(2, newest + 1, 2)]  # every 2 steps
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", *complete], "a failed save was left, or one too many kept"
    leftovers = [str(p) for p in checkpoints.rglob(".*") if p.name.startswith((".partial-", ".deleting-")) or ".tmp" in p.name]
    assert leftovers == [], f"a failed save left {leftovers}"
    return line
