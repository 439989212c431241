"""The tests' ``python -m lit_dist ...`` without its 4 s of import each time: a warm process per pytest process.

Most of the suite's process tests run the real command line (tests/conftest.py ``run_module``), and each run's
first 4 s of CPU were the same import of torch, Lightning and lit-dist: a third of the whole suite on CI's two
cores. Here one process per pytest process imports that once and forks each run from itself, through the code
lit-dist's own local ranks start with (lit_dist/runtime/warm_ranks.py ``run_as_command``): the fork sets the
run's environment, working folder and arguments, runs the module as ``python -m`` runs it (``runpy``, so that
``__main__`` and a spawned loader worker's ``__mp_main__`` are what they would be) and exits as that interpreter
would. The run is its own session leader (``start_new_session``), writes into pipes of the test's, and the warm
process reports its exit status as ``subprocess.Popen`` would. ``Zygote.run`` waits for the run's end (``run_module``);
``Zygote.start`` returns it running, held as a ``subprocess.Popen`` (``WarmRun``; conftest's ``start_module``).

What a fork cannot give is kept out: a run whose environment differs from the warm process's in anything read at
import (``IMPORT_TIME_ENV``: thread counts, torch's and Hugging Face's settings, paths), a run under a launcher
(torchrun) or with ``LIT_DIST_TEST_ZYGOTE=0`` starts as a new interpreter, as before.

    python -m tests.helpers.zygote FD     # FD: its end of a socket pair, from ``Zygote()``
"""

import array
import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lit_dist.runtime.warm_ranks import WarmRank

SWITCH_ENV = "LIT_DIST_TEST_ZYGOTE"  # "0": every run a new interpreter
WARM_MODULES = ("lit_dist.cli.app",)  # what every run imports first
# What runs import after it, once their config is read: about 0.5 s of CPU for a classifier's run, 1.5 s for a
# pipeline's, in each of its processes. The optional extras as a run imports them (``require``: diffusers and peft
# without bitsandbytes), and the classes of theirs that runs use, which their packages load on first use.
# torch's inductor: DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose torch.compile decorators import
# it, 2-4 s of CPU in each process of a ZeRO run (about a sixth of a 2-process Flux LoRA case under ZeRO-2).
WARM_AFTER = ("lit_dist.model.module", "lit_dist.data.datamodule", "lit_dist.callbacks.checkpoint", "lit_dist.cache.build",
              "torch.utils.tensorboard", "pyarrow.dataset", "s3fs", "torch._inductor.compile_fx")
WARM_EXTRAS = {"diffusers": ("UNet2DConditionModel", "AutoencoderKL", "DiffusionPipeline", "DDIMScheduler"),
               "transformers": ("CLIPTextModel", "T5EncoderModel")}
# Read at import by torch, OpenMP, Hugging Face, Python itself or the paths they cache: a run that sets one of
# these differently from the warm process gets a new interpreter. TMPDIR is not: the one module that reads it at
# import (torchmetrics' BLEU) is none of lit-dist's business, and each run looks it up again (``_main``).
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "HF_", "HUGGINGFACE", "TRANSFORMERS",
                   "DIFFUSERS", "TOKENIZERS", "PYTHON", "LD_", "CUDA", "NCCL", "GLOO", "PL_", "LIGHTNING",
                   "JSONARGPARSE", "TQDM", "XDG_", "HOME", "LANG", "LC_", "PATH")
_REAP_S = 0.02  # how often the warm process looks for ended runs


class Zygote:
    """A pytest process's handle on its warm process."""

    def __init__(self, env: dict, fork: bool = False):
        """``fork``: a fork of this process instead of a new interpreter (``_fork_warm``), for a process that has
        imported what runs import already: a benchmark's short run, itself forked from the tests' warm process,
        whose own warm process took 5-8 s of CPU to start (twenty short runs in the suite). OSError where there is
        none."""
        self.env = dict(env)
        mine, theirs = socket.socketpair()
        if fork:
            try:
                self.proc = _fork_warm(mine, theirs, self.env)
            except OSError:
                mine.close()
                theirs.close()
                raise
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.zygote", str(theirs.fileno())],
                                         env=self.env, cwd=Path(__file__).resolve().parents[2],
                                         stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()
        if self.sock.recv(1) != b"+":  # its imports are done (or it failed: no warm process, runs start as before)
            self.close()  # reaped
            raise OSError("the tests' warm process did not start")

    def can_run(self, env: dict, launcher: list[str] | None) -> bool:
        """Whether a fork of the warm process runs ``python -m ...`` with ``env`` as a new interpreter would."""
        if launcher or env.get(SWITCH_ENV) == "0" or self.proc.poll() is not None:
            return False
        names = {*env, *self.env}
        return not any(n.startswith(IMPORT_TIME_ENV) and env.get(n) != self.env.get(n) for n in names)

    def run(self, module: str, args: list[str], env: dict, cwd: str, timeout: float,
            signal_run) -> tuple[int, int, str, str, bool]:
        """(pid, exit code as ``Popen.returncode``, stdout, stderr, whether it hung) of ``python -m module args`` in
        ``cwd`` with ``env``. One that hangs past ``timeout`` gets ``signal_run(pid, SIGABRT)`` (its stacks), and
        SIGKILL 30 s later."""
        pid, reply, out_r, err_r = self._fork(module, args, env, cwd)
        streams = _Streams(out_r, err_r)
        with reply, streams:
            hung = not streams.read_until_end(time.monotonic() + timeout)
            if hung:
                signal_run(pid, signal.SIGABRT)
                if not streams.read_until_end(time.monotonic() + 30):
                    signal_run(pid, signal.SIGKILL)
                    streams.read_until_end(time.monotonic() + 30)
            code = struct.unpack("!i", _receive(reply, 4))[0]
        return pid, code, *(_text(b"".join(chunks)) for chunks in streams.chunks.values()), hung

    def start(self, module: str, args: list[str], env: dict, cwd: str) -> "WarmRun":
        """``python -m module args`` in ``cwd`` with ``env``, running: held as the tests hold a ``subprocess.Popen``."""
        pid, reply, out_r, err_r = self._fork(module, args, env, cwd)
        return WarmRun([sys.executable, "-m", module, *args], pid, reply, out_r, err_r)

    def _fork(self, module: str, args: list[str], env: dict, cwd: str) -> tuple[int, socket.socket, int, int]:
        """(pid, the socket its exit status comes through, read ends of its stdout and stderr) of a new run."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        reply, theirs = socket.socketpair()
        try:
            request = pickle.dumps((module, args, env, cwd))
            fds = array.array("i", [theirs.fileno(), out_w, err_w])
            with self.lock:
                self.sock.sendmsg([struct.pack("!I", len(request)) + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        pid = struct.unpack("!i", _receive(reply, 4))[0]
        if pid < 0:
            for fd in (out_r, err_r):
                os.close(fd)
            reply.close()
            raise OSError(-pid, os.strerror(-pid))
        return pid, reply, out_r, err_r

    def close(self) -> None:
        self.sock.close()  # it ends at the end of its socket
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WarmRun(WarmRank):
    """A run forked by the warm process, as ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True,
    start_new_session=True)`` holds one: lit-dist's ``WarmRank`` (``pid``, its session's id too, ``returncode``,
    ``wait``, signals) with ``stdout`` and ``stderr`` in text mode and ``communicate``. Its exit status comes from the
    warm process, which reaps it."""

    def __init__(self, args: list[str], pid: int, reply: socket.socket, out_fd: int, err_fd: int):
        import locale

        super().__init__(pid, args)
        self._reply = reply
        self.stdout, self.stderr = (open(fd, encoding=locale.getpreferredencoding(False)) for fd in (out_fd, err_fd))
        self._readers: list[threading.Thread] = []
        self._read: dict = {}

    def poll(self) -> int | None:
        if self.returncode is None and _readable([self._reply.fileno()], 0):
            self.returncode = struct.unpack("!i", _receive(self._reply, 4))[0]
            self._reply.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their ends and the exit status; past ``timeout`` TimeoutExpired, and a later call goes on."""
        if not self._readers:
            self._readers = [threading.Thread(target=self._read_all, args=(s,), daemon=True)
                             for s in (self.stdout, self.stderr)]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._read[self.stdout], self._read[self.stderr]

    def _read_all(self, stream) -> None:
        self._read[stream] = stream.read()
        stream.close()


class _Streams:
    """The read ends of a run's stdout and stderr, and what came through each."""

    def __init__(self, *fds: int):
        self.chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
        self.open = list(fds)

    def read_until_end(self, deadline: float) -> bool:
        """Read until every writer is gone (True), or until ``deadline`` (False; a later call reads on)."""
        while self.open:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = _readable(self.open, left)
            for fd in ready:
                if data := os.read(fd, 1 << 16):
                    self.chunks[fd].append(data)
                else:
                    self.open.remove(fd)
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self.chunks:
            os.close(fd)


def _readable(fds: list[int], timeout: float | None) -> list[int]:
    """Those of ``fds`` with something to read (or at their end) within ``timeout`` seconds (None: no limit).
    ``poll``, not ``select``: a pytest process that has run many tests holds descriptors past select's 1024."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)]


def _text(data: bytes) -> str:
    """As ``Popen(text=True)`` reads a stream: the locale's encoding, universal newlines."""
    import locale

    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def _receive(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) < size:
        raise EOFError("the tests' warm process ended")
    return data


# -- the warm process ----------------------------------------------------------------------------------------------

def _fork_warm(mine: socket.socket, theirs: socket.socket, env: dict) -> WarmRank:
    """A warm process forked from this one, serving ``theirs``; its runs get ``env`` as a new interpreter started
    with it would. OSError where a fork is not safe: another thread runs (a fork of it can deadlock), torch runs
    more than one thread (GNU OpenMP's pool does not survive a fork), or the warm modules are not imported here."""
    import torch

    bars = sys.modules.get("tqdm.std")
    if bars is not None and bars.tqdm.monitor is not None:  # every bar starts it, even a disabled one; the next restarts it
        bars.tqdm.monitor.exit()  # wakes from its wait and ends: no lock of tqdm's held across the fork
        bars.tqdm.monitor = None
    if threading.active_count() > 1 or torch.get_num_threads() != 1 or not set(WARM_MODULES) <= sys.modules.keys():
        raise OSError("this process cannot fork a warm process")
    for stream in (sys.stdout, sys.stderr):  # what the caller printed is the caller's, not in its runs' output
        stream.flush()
    pid = os.fork()
    if pid == 0:  # never returns into the caller's code
        code = 0
        try:
            import atexit

            atexit._clear()  # noqa: SLF001 - the forking process's exit handlers are not its runs'
            mine.close()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # the caller's streams stay the caller's: its reader waits for their end
                os.dup2(devnull, fd)
            if env.get("PYTHONFAULTHANDLER"):
                import faulthandler

                faulthandler.enable()  # what the variable does at an interpreter's start
            _main(theirs.detach())
        except BaseException:  # noqa: BLE001 - no traceback into the caller's streams; the caller sees no "+"
            code = 1
        finally:
            os._exit(code)
    return WarmRank(pid, [sys.executable])  # lit-dist's handle on a forked child, held as a Popen


def _serve(control: socket.socket) -> tuple[str, list[str], dict, str] | None:
    """The warm process's loop, until the test's end of ``control`` closes. Returns only in a forked run: its
    (module, args, env, cwd)."""
    from lit_dist.runtime.processes import die_with_parent

    die_with_parent(os.getppid())
    waiting: dict[int, socket.socket] = {}  # run pid -> where its exit status goes
    while True:
        ready, _, _ = select.select([control], [], [], _REAP_S)
        if ready:
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
            if not message:
                return None
            size = struct.unpack("!I", message[:4])[0]
            while len(message) < 4 + size:
                message += _receive(control, 4 + size - len(message))
            request = pickle.loads(message[4:4 + size])
            reply = socket.socket(fileno=fds[0])
            try:
                pid = os.fork()
            except OSError as exc:
                pid = -(exc.errno or 1)
            if pid == 0:
                control.close()
                for other in waiting.values():
                    other.close()
                reply.close()
                _become_run(fds[1], fds[2])
                return request
            for fd in fds[1:]:
                os.close(fd)
            reply.sendall(struct.pack("!i", pid))
            if pid > 0:
                waiting[pid] = reply
            else:
                reply.close()
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            if (reply := waiting.pop(pid, None)) is not None:
                with contextlib.suppress(OSError):
                    reply.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                reply.close()


def _become_run(stdout: int, stderr: int) -> None:
    """In the fork: a session of its own, the test's pipes as its streams, nothing else of the warm process's."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _warm_after() -> None:
    """``WARM_AFTER`` and ``WARM_EXTRAS``, each where it is installed (a missing one is a run's own business)."""
    import importlib

    from lit_dist.runtime.extras import require

    for name in WARM_AFTER:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for package, names in WARM_EXTRAS.items():
        with contextlib.suppress(Exception):
            require(package, "the tests' warm process")
            for name in names:
                getattr(sys.modules[package], name)


def _main(fd: int) -> None:
    import importlib
    import runpy

    from lit_dist.runtime import warm_ranks

    control = socket.socket(fileno=fd)
    for name in WARM_MODULES:
        importlib.import_module(name)
    _warm_after()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C of the test session is for pytest; its runs get their own
    control.sendall(b"+")
    request = _serve(control)
    if request is None:
        return
    module, args, env, cwd = request
    sys.path[0] = cwd  # as ``python -m`` puts it
    tempfile.tempdir = None  # found again from the run's TMPDIR on first use, as in a new interpreter
    warm_ranks.run_as_command(lambda _: runpy.run_module(module, run_name="__main__", alter_sys=True), args, env, cwd)


if __name__ == "__main__":
    _main(int(sys.argv[1]))
