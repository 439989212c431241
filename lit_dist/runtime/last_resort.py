"""A rank's last-resort stop: every thread's stack dumped and the process ended with exit 12, without the
interpreter's help.

The hang watchdog is a Python thread. A rank stuck while holding the interpreter lock (a C extension's loop, a
catastrophic regular expression, a call into native code that never returns) runs neither it nor any Python
signal handler, SIGTERM's included: it would write no stacks and outlive the job. Two timers that run in C do
not need the lock: faulthandler's (it writes every thread's Python stack to the rank's hang file) and, a few
seconds later, a POSIX timer whose thread is libc's ``_exit`` called with 12 (``ExitCode.HUNG``). The watchdog
thread pushes both deadlines forward while the rank makes progress, so they fire only when it cannot.

Where POSIX timers are missing (not Linux), faulthandler ends the process itself, with exit 1.
"""

import ctypes
import faulthandler
import os
import signal
import sys
import time

from lit_dist.errors import ExitCode
from lit_dist.runtime import processes

EXIT_AFTER_DUMP_S = 2.0  # from the dump to the exit: time for faulthandler to write every thread's stack
_CLOCK_MONOTONIC = 1
_SIGEV_THREAD = 2
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class _SigevThread(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p)]


class _SigevDetail(ctypes.Union):
    _fields_ = [("pad", ctypes.c_int * 12), ("thread", _SigevThread)]  # glibc's sigevent is 64 bytes


class _Sigevent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int), ("detail", _SigevDetail)]


class _Timespec(ctypes.Structure):
    _fields_ = [("seconds", ctypes.c_long), ("nanoseconds", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


class LastResort:
    """Dumps this process's stacks to ``path`` and exits 12 once ``arm(seconds)`` passes without another arm."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self._file = open(path, "a")  # noqa: SIM115 - faulthandler writes to its descriptor until close()
        self._timer = self._exit_timer()

    @staticmethod
    def _exit_timer() -> ctypes.c_void_p | None:
        """A POSIX timer whose expiry runs ``_exit(12)`` in a thread of its own; None where there is none."""
        if _LIBC is None:
            return None
        event = _Sigevent(value=int(ExitCode.HUNG), notify=_SIGEV_THREAD)
        event.detail.thread.function = ctypes.cast(_LIBC._exit, ctypes.c_void_p)  # void _exit(int): the value
        timer = ctypes.c_void_p()
        if _LIBC.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            return None
        return timer

    def arm(self, seconds: float) -> None:
        """Dump in ``seconds``, exit ``EXIT_AFTER_DUMP_S`` after that, unless armed again or disarmed first."""
        seconds = max(seconds, 0.001)
        faulthandler.dump_traceback_later(seconds, file=self._file, exit=self._timer is None)
        self._set(seconds + EXIT_AFTER_DUMP_S)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        self._set(0.0)

    def _set(self, seconds: float) -> None:
        if self._timer is None:
            return
        whole = int(seconds)
        spec = _Itimerspec(value=_Timespec(whole, int((seconds - whole) * 1e9)))  # zero disarms it
        _LIBC.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def close(self) -> None:
        """Disarm both timers; remove the hang file if nothing was written to it."""
        self.disarm()
        if self._timer is not None:
            _LIBC.timer_delete(self._timer)
            self._timer = None
        self._file.close()
        try:
            if os.path.getsize(self.path) == 0:
                os.remove(self.path)
        except FileNotFoundError:
            pass


# -- helper processes' stacks, on request ----------------------------------------------------------------------
# A loader worker blocked in a read (a file on a hung network mount) is where a "waiting for the batch" hang
# really is, but the rank's dump shows only its own threads. Each worker registers faulthandler for DUMP_SIGNAL
# (it writes the stacks from C, even while the worker is blocked in a system call), into a file next to its
# rank's; the rank's watchdog signals them when it dumps.
DUMP_SIGNAL = signal.SIGUSR2
WORKER_DUMPS_ENV = "LIT_DIST_WORKER_DUMPS"  # set by a rank's watchdog: its workers' dump files' common prefix
_registered = []  # the files faulthandler writes to must stay open


def dump_on_request(path: str) -> None:
    """In a helper process: write every thread's stack to ``path`` when DUMP_SIGNAL arrives."""
    handle = open(path, "a")  # noqa: SIM115 - faulthandler keeps its descriptor
    faulthandler.register(DUMP_SIGNAL, file=handle, all_threads=True, chain=True)  # then a Python handler, if any
    _registered.append(handle)


def dump_helpers(prefix: str, wait_s: float = 2.0) -> list[str]:
    """Signal this rank's helpers that dump on request (the descendants writing to ``prefix``-worker-pid-*.txt)
    and wait up to ``wait_s`` for each to write the file it reads; one line each: pid, state, what it waits in
    (the kernel's wait channel) and the files it has open.

    Rank 0 started by Lightning's launcher is the parent of the other ranks of its node: their workers are its
    descendants too, but they are theirs to signal. Two ranks signalling one worker at once made each see it
    running, or not at all, in its own list. The wait: a rank that says it has dumped may be ended at once by
    the others, and its workers with it."""
    lines, mine = [], os.path.realpath(prefix) + "-worker-pid-"  # the kernel names open files by real path
    written: dict[str, int] = {}  # each signalled worker's file: its length before the signal
    for pid in processes.descendants(os.getpid()):
        if not processes.catches(pid, int(DUMP_SIGNAL)):
            continue  # the fork server, the resource tracker: the signal would end them
        files = sorted(processes.open_files(pid))
        if f"{mine}{pid}.txt" not in files:
            continue  # another rank's worker
        written[f"{mine}{pid}.txt"] = len(_read(f"{mine}{pid}.txt"))  # in characters, as it is sliced below
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            continue
        wchan = processes.waits_in(pid)  # hidden on many kernels
        waits = f", waiting in {wchan}" if wchan else ""
        lines.append(f"helper process pid {pid} ({processes.state(pid)}{waits}): open files: {', '.join(files) or 'none'}")
    deadline = time.monotonic() + wait_s  # a worker in the kernel's uninterruptible wait writes its stacks only
    while written and time.monotonic() < deadline:
        written = {path: size for path, size in written.items() if "\nreading: " not in _read(path)[size:]}
        time.sleep(0.05)
    return lines




def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process ended meanwhile
        return ""
