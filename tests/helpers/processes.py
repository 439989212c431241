"""A run's processes, found by their session (``lit_dist`` in tests/conftest.py starts each run in a session of
its own), never by name: whatever a run starts (ranks, fork servers, loader workers, resource trackers) is in
it unless it calls setsid itself."""

import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from lit_dist.runtime.processes import tagged


def session_processes(sid: int) -> dict[int, str]:
    """{pid: command line} of the live (not zombie) processes of session ``sid``."""
    found = {}
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                found[proc.pid] = " ".join(proc.info["cmdline"] or [])
        except (ProcessLookupError, PermissionError):
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
            found.setdefault(pid, " ".join(psutil.Process(pid).cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
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


class Output:
    """Reads the stdout and stderr of ``proc`` (started with both piped) as they come, in two threads."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines = {"out": [], "err": []}
        self.times: list[float] = []  # when each line of stderr came (time.monotonic)
        self.ended_at: float | None = None  # when the process exited
        self._ended = set()
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                         for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            with self._changed:
                self.lines[name].append(line)
                if name == "err":
                    self.times.append(time.monotonic())
                self._changed.notify_all()
        with self._changed:
            self._ended.add(name)
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 180) -> bool:
        """Whether a line of stderr holds ``text`` before stderr ends or ``timeout`` seconds pass."""
        with self._changed:
            self._changed.wait_for(lambda: "err" in self._ended or any(text in line for line in self.lines["err"]),
                                   timeout)
            return any(text in line for line in self.lines["err"])

    def tail(self) -> str:
        with self._changed:
            return "".join(self.lines["err"])[-3000:]

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        """(return code, stdout, stderr), as ``tests.helpers.processes.finish``: on a hang the run's whole session
        is killed and the test fails with the end of its stderr."""
        try:
            self.proc.wait(timeout)
            self.ended_at = time.monotonic()
            for reader in self._readers:  # what the run's other processes still hold open ends with them
                reader.join(timeout)
            if any(reader.is_alive() for reader in self._readers):
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for reader in self._readers:
                reader.join(10)
            pytest.fail(f"the run hung:\n{''.join(self.lines['err'])[-5000:]}")
        return self.proc.returncode, "".join(self.lines["out"]), "".join(self.lines["err"])

    def seconds_after(self, text: str) -> float:
        """Seconds from the first line of stderr holding ``text`` to the process's exit (after ``finish``)."""
        at = next(t for line, t in zip(self.lines["err"], self.times, strict=True) if text in line)
        return self.ended_at - at
