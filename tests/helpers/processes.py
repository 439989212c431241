"""A run's processes, found by their session (``lit_dist`` in tests/conftest.py starts each run in a session of
its own), never by name: whatever a run starts (ranks, fork servers, loader workers, resource trackers) is in
it unless it calls setsid itself."""

import os
import signal
import time

from lit_dist.processes import tagged


def session_processes(sid: int) -> dict[int, str]:
    """{pid: command line} of the live (not zombie) processes of session ``sid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # ended while we looked
    return found


def left_after(sid: int, bound_s: float, tag: tuple[str, str] | None = None) -> dict[int, str]:
    """The processes of session ``sid`` (and those started with the environment variable ``tag``, (name, value),
    in whatever session: torchrun starts each worker in a session of its own) still alive ``bound_s`` seconds from
    now (checked until then), then SIGKILLs them so that one failing test leaves nothing to the next."""
    deadline = time.monotonic() + bound_s
    left = _run_processes(sid, tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _run_processes(sid, tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _run_processes(sid: int, tag: tuple[str, str] | None) -> dict[int, str]:
    found = session_processes(sid)
    for pid in tagged(*tag) if tag else []:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.setdefault(pid, f.read().replace(b"\0", b" ").decode(errors="replace").strip())
        except OSError:
            continue  # ended while we looked
    return found


def finish(proc, timeout: float = 300):
    """(return code, stdout, stderr) of a run started in its own session; on a hang its whole session is killed
    and the test fails with the end of its stderr."""
    import subprocess

    import pytest

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run hung:\n{err[-5000:]}")
    return proc.returncode, out, err
