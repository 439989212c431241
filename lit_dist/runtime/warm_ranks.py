"""Local ranks from a warm copy of the launching process, instead of new interpreters.

With ``trainer.devices: N`` on one machine (no srun, no torchrun), Lightning's launcher starts ranks 1..N-1 as
new ``lit-dist`` processes once rank 0 has parsed its config and built its model and data module, and each then
imports torch, Lightning and lit-dist again: 4 s of CPU per rank, and the run's first step waits for the last of
them (a 2-process quickstart took 11.4 s to its end where one process took 6.5). Here the ``lit-dist`` command
forks a *zygote* of itself right after its imports, before it runs anything (``__main__.py``); the launcher asks
the zygote for each rank (``launch``), and the zygote forks it: a process that has imported everything already
and then runs the command line as a new interpreter would, with the environment and working folder the launcher
gave it.

- The rank is a child of rank 0, as a launched one is: the zygote forks through a short-lived middle process
  whose exit hands the rank to rank 0 (Linux's child subreaper, set while ranks are being started), so rank 0
  reaps it, reads its exit code (``WarmRank``, shaped like the ``subprocess.Popen`` it replaces) and the rank
  dies with rank 0 (``processes.join_launcher``).
- The zygote is single-threaded (forked only where no other Python thread runs: a fork of a process with more
  threads can deadlock), ignores the stop signals (the training processes act on them) and dies with rank 0.
- State that a new interpreter would read from its environment at import is read again in the rank: Lightning's
  ``rank_zero_only.rank``. Anything else imports do is the same for every rank of a run.
- Where a zygote cannot be made (another thread runs, not Linux, a user's own script), or the command the
  launcher asks for is not ``lit-dist``'s, ranks start as before; ``LIT_DIST_WARM_RANKS=0`` in the environment
  asks for that too.
"""

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from lit_dist.runtime.processes import parent_of

# SIGINT as this interpreter found it: a process started with it ignored (a background job of a script) keeps it
# ignored, as Python does; a new interpreter started from this one would inherit that too.
_SIGINT_IGNORED_AT_START = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
SWITCH_ENV = "LIT_DIST_WARM_RANKS"  # "0": local ranks start as new interpreters, as Lightning starts them
_PR_SET_CHILD_SUBREAPER = 36
_ZYGOTE: "Zygote | None" = None  # this process's, once made


class Zygote:
    """Rank 0's handle on its zygote: a socket to ask it for ranks."""

    def __init__(self, pid: int, sock: socket.socket, argv0: str):
        self.pid, self.sock, self.argv0 = pid, sock, argv0
        self.lock = threading.Lock()

    def start(self, args: list[str], env: dict, cwd: str | None) -> int:
        """The pid of a new rank running ``lit-dist ARGS`` with ``env`` in ``cwd``, a child of this process."""
        request = pickle.dumps((args, env, cwd))
        with self.lock, _subreaper():
            self.sock.sendall(struct.pack("!I", len(request)) + request)
            pid = struct.unpack("!i", _receive(self.sock, 4))[0]
            if pid < 0:
                raise OSError(-pid, os.strerror(-pid))
            deadline = time.monotonic() + 10.0  # the middle process exits at once: the rank is ours within moments
            while parent_of(pid) not in (os.getpid(), None) and time.monotonic() < deadline:
                time.sleep(0.001)
        return pid


def prepare(argv: list[str], run: Callable[[list[str]], None]) -> bool:
    """In the ``lit-dist`` command, right after its imports: make the zygote if this command may start local ranks
    itself (it is not one of several processes a launcher started) and nothing else runs yet. Each rank it forks
    calls ``run`` with its arguments (the command's code after its imports). True if made."""
    global _ZYGOTE
    if _ZYGOTE is not None or not sys.platform.startswith("linux") or threading.active_count() != 1:
        return False
    if not argv or argv[0] not in ("fit", "validate", "test", "predict", "cache"):
        return False
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return False
    if any(name in os.environ for name in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")) or _slurm_tasks() > 1:
        return False  # a rank of a launched job: nothing to launch here
    parent_end, zygote_end = socket.socketpair()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        parent_end.close()
        zygote_end.close()
        return False
    if pid == 0:
        parent_end.close()
        _serve(zygote_end, os.getppid(), run)  # never returns
    zygote_end.close()
    _ZYGOTE = Zygote(pid, parent_end, sys.argv[0])
    return True


def done() -> None:
    """The local ranks are started: the zygote ends. Killed, not told: a helper forked from this process since
    (the loader workers' fork server) holds a copy of its socket, so closing ours is no end of file to it."""
    global _ZYGOTE
    if _ZYGOTE is not None:
        _ZYGOTE.sock.close()
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(_ZYGOTE.pid, signal.SIGKILL)  # it has nothing to lose: it waits for a request
            os.waitpid(_ZYGOTE.pid, 0)
        _ZYGOTE = None


def launch(command, env=None, cwd=None, **kwargs):
    """What Lightning's launcher calls in place of ``subprocess.Popen(command, env=..., cwd=...)``: a rank forked
    by the zygote where ``command`` runs ``lit-dist``, else the Popen it asked for."""
    args = _lit_dist_args(list(command))
    if _ZYGOTE is None or args is None or kwargs:
        return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
    try:
        pid = _ZYGOTE.start(args, dict(os.environ if env is None else env), cwd)
    except (OSError, EOFError, struct.error):  # the zygote is gone (killed): the usual start
        return subprocess.Popen(command, env=env, cwd=cwd)
    return WarmRank(pid, list(command))


def _lit_dist_args(command: list[str]) -> list[str] | None:
    """The arguments of a command that runs ``lit-dist`` as this process was run (``python -m lit_dist ...`` or the
    ``lit-dist`` script), else None."""
    if len(command) >= 3 and command[1] == "-m" and command[2] in ("lit_dist", "lit_dist.__main__"):
        return command[3:]
    if len(command) >= 2 and _ZYGOTE is not None and os.path.abspath(command[1]) == os.path.abspath(_ZYGOTE.argv0):
        return command[2:]
    return None


class WarmRank:
    """A rank the zygote started, as ``subprocess.Popen`` shows a child: ``pid``, ``poll``, ``wait``,
    ``returncode``, ``send_signal``, ``terminate``, ``kill``, ``args``. It is this process's child: waited for with
    ``waitpid``."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler): ended, how unknown
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# -- the zygote ---------------------------------------------------------------------------------------------------

def _serve(sock: socket.socket, parent: int, run: Callable[[list[str]], None]) -> None:
    """The zygote's loop: one rank per request, until rank 0 closes the socket or ends; never returns."""
    from lit_dist.runtime.processes import die_with_parent
    from lit_dist.runtime.slurm import STOP_SIGNALS

    code = 0
    try:
        die_with_parent(parent)
        for name in STOP_SIGNALS:  # the training processes act on them; the zygote has nothing to stop
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        while True:
            try:
                size = struct.unpack("!I", _receive(sock, 4))[0]
            except EOFError:
                break  # rank 0 is done starting ranks, or gone
            args, env, cwd = pickle.loads(_receive(sock, size))
            sock.sendall(struct.pack("!i", _fork_rank(run, args, env, cwd, sock)))
    except BaseException as exc:  # noqa: BLE001 - one line, then the zygote ends: rank 0 falls back to new processes
        print(f"lit-dist: the local ranks' zygote of pid {parent} failed: {exc!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        os._exit(code)


def _fork_rank(run: Callable[[list[str]], None], args: list[str], env: dict, cwd: str | None,
               sock: socket.socket) -> int:
    """Fork a middle process that forks the rank and exits at once (the rank is then handed to rank 0, the
    subreaper); the rank's pid, or minus an errno."""
    reader, writer = os.pipe()
    try:
        middle = os.fork()
    except OSError as exc:
        os.close(reader)
        os.close(writer)
        return -(exc.errno or 1)
    if middle == 0:
        os.close(reader)
        try:
            pid = os.fork()
        except OSError as exc:
            pid = -(exc.errno or 1)
        if pid == 0:
            os.close(writer)
            sock.close()
            run_as_command(run, args, env, cwd)  # never returns
        os.write(writer, struct.pack("!i", pid))
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as f:
        answer = f.read(4)
    os.waitpid(middle, 0)  # no zombie of it in the zygote
    return struct.unpack("!i", answer)[0] if len(answer) == 4 else -1


def run_as_command(run: Callable[[list[str]], None], args: list[str], env: dict, cwd: str | None) -> None:
    """In a process forked from a warm one (a rank here; a test's run in tests/helpers/zygote.py): become what
    ``python -m lit_dist ARGS`` started with ``env`` in ``cwd`` would be, call ``run(ARGS)`` and exit as that
    interpreter would; never returns."""
    code = 1
    try:
        for name in ("SIGUSR1", "SIGTERM"):  # the defaults a new interpreter has
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        # SIGINT: Python's own handler, or ignored where this process was started with it ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN if _SIGINT_IGNORED_AT_START else signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        if cwd:
            os.chdir(cwd)
        sys.argv = [sys.argv[0], *args]
        from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

        rank_zero_only.rank = _get_rank() or 0  # read at import from the environment, which is this rank's now
        code = _main(run, args)
    finally:
        _exit(code)


def _main(run: Callable[[list[str]], None], args: list[str]) -> int:
    """``run(args)``'s exit code, as an interpreter running it as its main would end with."""
    try:
        run(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug: its traceback, as a new interpreter would print it, then exit 1
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(code: int) -> None:
    """End as an interpreter ends: other threads joined, exit handlers run, streams flushed; then without unwinding
    into the zygote's loop."""
    try:
        threading._shutdown()  # noqa: SLF001 - what the interpreter calls first at exit
        import atexit

        atexit._run_exitfuncs()  # noqa: SLF001 - the exit handlers a normal exit runs (multiprocessing's, ...)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# -- helpers -------------------------------------------------------------------------------------------------------

def _receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


@contextlib.contextmanager
def _subreaper():
    """Within: this process adopts its orphaned descendants (the ranks whose middle process exited)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)



def _slurm_tasks() -> int:
    try:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        return 1
