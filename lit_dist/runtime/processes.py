"""The run's processes: none outlives the run, and one that dies is named, with how it ended.

On one machine Lightning's launcher starts ranks 1.. as children of rank 0, and every rank starts a fork
server, loader workers and multiprocessing's resource tracker. Left alone, a rank 0 that exits abruptly (a
hang's exit 12, a SIGKILL) leaves its children running, orphaned, each holding its share of memory and, on a
GPU node, its GPU; and Lightning's own observer of the children SIGKILLs rank 0 a few seconds after a child
ends with any non-zero code, so the job's exit code (137) no longer says what happened.

- Every helper process asks the kernel to end it when its parent ends (``die_with_parent``: Linux's
  ``PR_SET_PDEATHSIG``): a rank started by another lit-dist process (``join_launcher``), the fork server
  (imported ``lit_dist.runtime.orphan_guard``), each loader or pool worker (``lit_dist.reading.workers``). The resource
  tracker ends by itself once the last process holding its pipe has ended.
- ``ChildRanks`` replaces Lightning's observer in rank 0: a child that ends with a non-zero code ends the run
  with that code (a signal: ``ExitCode.PROCESS_DIED``), after one line naming the rank, its pid and host, and
  how it ended. Codes every rank reaches by agreement (preempted, hung, ...) first give rank 0 time to finish
  its own part (the ``latest`` marker, the requeue).
- ``worker_death`` reads PyTorch's "DataLoader worker ... killed" errors into the same one line.
"""

import contextlib
import ctypes
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from lit_dist.errors import ExitCode, LitDistError

_PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "LIT_DIST_LAUNCHER_PID"  # the pid of the lit-dist process that started this one
# A child ending with one of these was agreed by every rank: rank 0 reaches the same end itself, given time.
_AGREED = {ExitCode.GPU_FAULT, ExitCode.PREEMPTED, ExitCode.HUNG, ExitCode.STRAGGLER, ExitCode.PREFLIGHT}
AGREED_GRACE_S = 60.0  # how long rank 0 may take to finish an agreed end after a child has (save, requeue)
_ended_here: set[int] = set()  # helpers this process ended itself (end_helpers): not the cause of a failure
GRACE_S = 3.0  # how long rank 0 may take to reach its own verdict after a child failed alone
# Faults every rank meets at once (a sharded save on a full disk, a store that went away): rank 0 is on its way to
# the same end and its own line; on a loaded machine it took over 3 s (CI), and the run then ended without it.
_SHARED = {ExitCode.STORAGE_FULL, ExitCode.STORE_UNREACHABLE}
SHARED_GRACE_S = 15.0
_MEANINGS = {
    "SIGKILL": "what the kernel's out-of-memory killer sends: see `dmesg` or the job's memory accounting",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, often shared memory (/dev/shm) running out",
    "SIGABRT": "an abort in native code",
    "SIGTERM": "stopped from outside",
    "SIGINT": "interrupted",
}


class ProcessDied(LitDistError):
    """A rank or a data loader worker of the run died: the run can be resumed from its last checkpoint."""

    exit_code = ExitCode.PROCESS_DIED


# -- what the system says of a process: psutil, in this one place --------------------------------------------------

def tagged(name: str, value: str) -> list[int]:
    """The live processes started with ``name=value`` in their environment: everything a command started, in
    whatever session (torchrun starts each worker in a session of its own) and whoever its parent is now. For
    whoever runs lit-dist as a child and must reach all of it (a benchmark, a test)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # ended while we looked, or another user's
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie, ended and waiting for its parent to reap it, does not; another user's
    process that we may not inspect does."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def started_at(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch; the same for every reader (None: it is gone)."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def age_s() -> float:
    """Seconds since this process started, to the kernel's clock tick (e.g. how long a restart took). Against the
    clock since boot: the epoch time of the boot is whole seconds, too coarse for an age."""
    since_boot = psutil.Process().create_time() - psutil.boot_time()  # the start in ticks after boot, exactly
    return time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot


def parent_of(pid: int) -> int | None:
    """The pid of ``pid``'s parent now (None: it is gone)."""
    try:
        return psutil.Process(pid).ppid()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def state(pid: int) -> str:
    """What the kernel says ``pid`` is doing ("sleeping", "disk-sleep", ...), or "gone"."""
    try:
        return psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "gone"
    except psutil.AccessDenied:
        return "?"


def open_files(pid: int) -> list[str]:
    """The regular files ``pid`` has open, by real path."""
    try:
        return [f.path for f in psutil.Process(pid).open_files()]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


# psutil has neither a process's caught signals nor its wait channel: these two read /proc (Linux) themselves.
def catches(pid: int, number: int) -> bool:
    """Whether ``pid`` has a handler for signal ``number`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((line.split()[1] for line in f if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(mask, 16) >> (number - 1) & 1)


def waits_in(pid: int) -> str:
    """The kernel function ``pid`` sleeps in ("" where the kernel hides it, or it runs)."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            found = f.read().strip()
    except OSError:
        return ""
    return "" if found == "0" else found


def die_with_parent(parent: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent ends (Linux); False where it cannot.

    ``parent``: the pid this process expects as its parent; if that one already ended before the request
    took effect, end now."""
    if not sys.platform.startswith("linux"):
        return False
    expected = os.getppid() if parent is None else parent
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != expected:  # the parent ended before the request: the kernel will not signal now
        os._exit(int(ExitCode.PROCESS_DIED))
    return True


# What multiprocessing's resource tracker warns with; the -W option its interpreter inherits from this one's.
_TRACKER_WARNINGS = "ignore::UserWarning:multiprocessing.resource_tracker"


def quiet_resource_tracker() -> None:
    """Before this process starts multiprocessing's resource tracker (a process of its own, whose interpreter
    takes this one's -W options): no warnings from it. It warns ("leaked semaphore objects to clean up") of what
    a process left when it ended without releasing it (a rank or worker killed, or ended at once with os._exit),
    and releases it. For lit-dist such an end is a fault that already has its one line, or an end on purpose."""
    if _TRACKER_WARNINGS not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_WARNINGS)


def join_launcher() -> None:
    """In a process started by another lit-dist process (Lightning's launcher in rank 0, ``lit-dist scale``):
    end with it. Then mark this process as the launcher of whatever it starts."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and launcher.isdigit() and int(launcher) != os.getpid():
        if int(launcher) == os.getppid():
            die_with_parent(int(launcher))
    os.environ[LAUNCHER_ENV] = str(os.getpid())


def how_it_ended(returncode: int) -> str:
    """'was killed by SIGKILL (...)' or 'ended with exit 3 (DATA_ERROR)' for a process's return code."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
        meaning = _MEANINGS.get(name)
        return f"was killed by {name}" + (f" ({meaning})" if meaning else "")
    try:
        return f"ended with exit {returncode} ({ExitCode(returncode).name})"
    except ValueError:
        return f"ended with exit {returncode}"


def run_code(returncode: int) -> ExitCode:
    """The run's exit code when one of its processes ended with ``returncode``."""
    if returncode < 0:
        return ExitCode.PROCESS_DIED
    try:
        return ExitCode(returncode)
    except ValueError:
        return ExitCode.FAILURE


class ChildRanks(threading.Thread):
    """Rank 0's watch over the ranks it started (in place of Lightning's ``_ChildProcessObserver``)."""

    current: "ChildRanks | None" = None

    def __init__(self, procs: list, poll_s: float = 0.5):
        super().__init__(daemon=True, name="lit-dist-child-ranks")
        self.procs = procs
        self.poll_s = poll_s
        base = int(os.environ.get("NODE_RANK", 0)) * (len(procs) + 1)
        self.ranks = [base + i + 1 for i in range(len(procs))]
        self._said = threading.Lock()
        self._done = False

    @classmethod
    def start_for(cls, procs: list) -> None:
        """Lightning's launcher calls this with the children it started."""
        cls.current = cls(procs)
        cls.current.start()

    def ended(self) -> tuple[int, int, int] | None:
        """(rank, pid, return code) of the first child that ended with a non-zero code, or None."""
        for rank, proc in zip(self.ranks, self.procs, strict=True):
            if proc.poll():
                return rank, proc.pid, proc.returncode
        return None

    def conclude(self, rank: int, pid: int, returncode: int) -> ExitCode:
        """Say once how the child ended; the run's exit code."""
        code = run_code(returncode)
        with self._said:
            if not self._done:
                self._done = True
                verdict = "error" if code == ExitCode.PROCESS_DIED else "stopping"
                print(f"lit-dist: {verdict}: rank {rank} (pid {pid} on {socket.gethostname()}) {how_it_ended(returncode)}; "
                      f"the run ends with exit {int(code)}" + ("; resume it from its last checkpoint" if
                                                               code == ExitCode.PROCESS_DIED else ""),
                      file=sys.stderr, flush=True)
        return code

    def run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            if all(p.poll() == 0 for p in self.procs):
                return
            found = self.ended()
            if found is None:
                continue
            rank, pid, returncode = found
            # This process's own path usually gets there first (a broken collective reaches main(), which asks
            # blame_child); this is for a rank 0 that would otherwise wait on its dead peer.
            code = run_code(returncode)
            time.sleep(AGREED_GRACE_S if code in _AGREED else SHARED_GRACE_S if code in _SHARED else GRACE_S)
            end_run(self.conclude(rank, pid, returncode))


def blame_child(wait_s: float = 3.0) -> ExitCode | None:
    """In rank 0, after an unexpected error: if a child rank ended first (its end broke our collective), say so
    and give the run's exit code; None when no child did within ``wait_s``."""
    watch = ChildRanks.current
    if watch is None:
        return None
    deadline = time.monotonic() + wait_s
    while (found := watch.ended()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return watch.conclude(*found) if found else None


def let_children_finish(code: int) -> None:
    """In rank 0, ending with ``code``: when it is an end every rank reaches (a full disk, a store gone, a
    preemption...), wait up to SHARED_GRACE_S for the child ranks to say their own line and exit, since this
    process's exit ends them (``die_with_parent``); a rank behind by a moment was otherwise cut off unheard."""
    watch = ChildRanks.current
    if watch is None or run_code(code) not in _SHARED | _AGREED:
        return
    deadline = time.monotonic() + SHARED_GRACE_S
    for proc in watch.procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def end_run(code: int) -> None:
    """End this process now with ``code``, and the child ranks it started (stuck in a collective with a dead
    peer, they have nothing left to save)."""
    for proc in ChildRanks.current.procs if ChildRanks.current else []:
        if proc.poll() is None:
            proc.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def end_helpers(wait_s: float = 5.0) -> list[int]:
    """End this process's daemonic multiprocessing children (loader workers) now, with SIGKILL: they ignore the
    SIGTERM multiprocessing would send (lit_dist/reading/workers.py), and nothing they do is wanted once this
    process ends (a batch being read is dropped with it). Waits up to ``wait_s`` for each to be reaped; returns
    the pids ended."""
    if threading.current_thread() is threading.main_thread():
        # PyTorch's SIGCHLD handler would raise "DataLoader worker ... killed" for the kill below (fork start).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ended = []
    for child in multiprocessing.active_children():
        if child.daemon:
            with contextlib.suppress(OSError, ValueError):  # ended meanwhile, or closed
                child.kill()
                ended.append(child.pid)
                _ended_here.add(child.pid)
    for child in multiprocessing.active_children():
        if child.pid in ended:
            with contextlib.suppress(OSError, ValueError):
                child.join(wait_s)
    return ended


# PyTorch's errors for a loader worker that died (torch/utils/data/dataloader.py and its SIGCHLD handler).
_WORKER_DIED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: ([^.]+)\.|exited "
                          r"unexpectedly(?: with exit code (-?\d+))?)")
_SIGNAL_BY_TEXT = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}


def worker_death(exc: BaseException, rank: int) -> ProcessDied | None:
    """A ProcessDied for PyTorch's error about a dead loader worker (anywhere in ``exc``'s chain), else None."""
    found, seen, handover = [], set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and (match := _WORKER_DIED.search(str(exc))):
            found.append(match.groups())
        elif isinstance(exc, (ConnectionError, EOFError)) and handover is None:
            handover = _loader_of(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
    if not found and handover is not None:
        # Killed while handing a batch over: the batch's shared memory travels as a file descriptor, fetched from
        # the worker over a socket that the kernel closes with the worker; torch raises the socket's error as is.
        dead = _dead_workers(handover)
        if dead:
            found = [(", ".join(str(pid) for pid, _ in dead), None, str(dead[0][1]))]
    if not found:
        return None
    # "exited unexpectedly" is often raised from the SIGCHLD handler's "is killed by signal": take the one that says how.
    pids, text, code = next((g for g in found if g[1] or g[2] is not None), found[0])
    pid = int(pids.split(",")[0])
    if text:
        name = _SIGNAL_BY_TEXT.get(text.strip(), text.strip())
        how = how_it_ended(-int(signal.Signals[name])) if name in signal.Signals.__members__ else f"was killed by {name}"
    elif code is not None:
        how = how_it_ended(int(code))
    elif (status := _worker_status(pid)) is not None:
        how = how_it_ended(status)
    else:
        how = "ended unexpectedly"
    return ProcessDied(f"rank {rank}: data loader worker (pid {pids.strip()}) {how}; if memory ran out, lower "
                       "data.num_workers or data.batch_size_per_device; resume the run from its last checkpoint")




def _loader_of(tb):
    """The loader iterator (PyTorch's, with worker processes) in whose ``next()`` a traceback was raised, or None."""
    loader = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith("torch/utils/data/dataloader.py"):
            candidate = tb.tb_frame.f_locals.get("self")
            if hasattr(candidate, "_workers"):
                loader = candidate
        tb = tb.tb_next
    return loader


def _dead_workers(loader, wait_s: float = 10.0) -> list[tuple[int, int]]:
    """(pid, return code) of ``loader``'s workers that have ended, waiting up to ``wait_s`` for their end to
    reach this process (the socket closes as the worker dies; its return code comes a moment later: from a fork
    server on a loaded machine, 2 s was once not enough). Only a failed handover waits."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = []
        for worker in loader._workers:
            try:
                if worker.exitcode is not None and worker.pid not in _ended_here:
                    dead.append((worker.pid, worker.exitcode))
            except ValueError:  # closed
                pass
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _worker_status(pid: int) -> int | None:
    """The return code of this process's worker ``pid``, from its ``multiprocessing`` Process object (under a fork
    server, the server reaps the worker and sends the code to that object, not to us: waitpid cannot)."""
    import gc
    import multiprocessing.process

    for obj in gc.get_objects():  # once, on the way out: the loader that held the worker is still referenced
        if isinstance(obj, multiprocessing.process.BaseProcess) and obj.pid == pid:
            try:
                return obj.exitcode
            except ValueError:  # closed
                return None
    return None
