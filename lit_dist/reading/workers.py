"""How worker processes start: fork where the interpreter forks safely, a fork server where it can deadlock.

Python 3.10 before 3.10.15 and 3.11 before 3.11.10 (CPython gh-112275; 3.12 has its own fix): a
process forked while another thread of its parent is creating a Python thread state inherits the
interpreter's thread-list lock held, and waits for it forever inside ``os.fork``. PyTorch's collective
threads (gloo's run loop, NCCL's watchdog) create one every time they drop a tensor that has a Python
object, which is just when a collective completes. A DataLoader that forks its workers right after a
collective (Lightning's sanity check, the start of training) then hangs in its first ``next()``:
measured here, one 2-process DDP start in about ten on 2 cores (the child's native stack:
``PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept -> PyThread_acquire_lock``).

``forkserver`` sidesteps it: every worker is forked from one single-threaded server process, and each
receives its dataset by pickle (a split's rows, not the whole table: see ``BucketImageDataset.__getstate__``)
instead of sharing the parent's memory. ``lit-dist`` makes that server a fork of the rank itself, taken right
after its imports and before it starts any thread (``fork_server_here``): the server then shares the rank's
imported torch, Lightning and lit-dist instead of importing them again (4.1 s of CPU and a second copy of
their memory per rank, measured on the quickstart). Where that cannot be done (another Python thread already
runs, a Python whose fork server this module does not know), the server is a new interpreter started by
multiprocessing (fork-and-exec: no Python runs between the two) that imports them itself; ``lit-dist`` then
starts it first thing (``__main__.py``), so that its import runs beside the rank's own, and a data module made outside
``lit-dist`` starts it when it is made. As with any start method but fork, a script that calls ``fit`` itself
needs ``if __name__ == "__main__":`` (``lit-dist fit`` has it).

Stop signals. Slurm signals every process of a job step (``--signal=USR1@120``, and SIGTERM when it
preempts or cancels), not only the training process. A worker, the fork server or multiprocessing's
resource tracker that died of it would take the run down with it: a worker killed while sending a batch
larger than a pipe's buffer leaves the training process waiting for the rest for ever (the pipe's write
end is still open in it), so it never reaches the step boundary where it would save. Only the training
process acts on them (an agreed save, then exit 11); the helpers ignore them and stop when it tells them
to or when it is gone (PyTorch's workers watch their parent).

Their end. A worker that ignores SIGTERM no longer ends the way multiprocessing ends daemonic children at
interpreter exit (SIGTERM, then a join without a timeout), and PyTorch skips its own orderly shutdown of a
loader once the interpreter is exiting. A loader still referenced at exit (a worker's exception re-raised in
the rank keeps its iterator alive in a reference cycle until a garbage collection that exit does not run), or
a worker still waiting out an outage, then held the rank in that join for ever after its error line (one
process, ``data.num_workers: 1``, the object store gone). So a process that made a worker context ends its
daemonic children itself at exit, with SIGKILL, before multiprocessing joins them (``end_helpers``).
"""

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.util  # its exit handler is registered on import: ours must come later, to run first
import os
import signal
import socket
import sys
import threading
from typing import Literal

from lit_dist.runtime.slurm import STOP_SIGNALS

Start = Literal["auto", "fork", "forkserver", "spawn"]
START_METHODS = ("auto", "fork", "forkserver", "spawn")

_reading: str | None = None  # the file this worker reads now (``reading``): a hang dump says it

# Modules every worker needs, imported once by the fork server instead of once per worker: Lightning's
# worker seeding function, and lit_dist.cli.app because each worker re-runs the `lit-dist` script (its
# __main__), which would otherwise import Lightning's CLI in every worker.
_PRELOAD = ["lit_dist.runtime.orphan_guard", "torch", "lightning.fabric.utilities.seed", "lit_dist.cli.app", "lit_dist.data.dataset", "lit_dist.cache.build"]


def fork_is_safe(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this Python forks a multi-threaded process without the gh-112275 deadlock."""
    if version[:2] == (3, 10):
        return version >= (3, 10, 15)
    if version[:2] == (3, 11):
        return version >= (3, 11, 10)
    return version >= (3, 12)


def method(start: Start = "auto") -> str:
    """The start method ``start`` means on this machine: auto is fork where it is safe, else forkserver."""
    if start == "auto":
        return "fork" if fork_is_safe() else "forkserver"
    return start


def context(start: Start = "auto") -> multiprocessing.context.BaseContext:
    """A multiprocessing context for worker processes (DataLoader workers, process pools)."""
    chosen = method(start)
    ctx = multiprocessing.get_context(chosen)
    _end_helpers_at_exit()
    if chosen == "forkserver":
        # Only takes effect before this process's server starts; later calls change nothing.
        ctx.set_forkserver_preload(_PRELOAD)
        _start_server()
    return ctx


_ends_at_exit = False


def _end_helpers_at_exit() -> None:
    """Register ``processes.end_helpers`` with atexit, once per process (atexit runs the last registered first, so it runs
    before multiprocessing's own exit handler, registered when multiprocessing.util was imported)."""
    global _ends_at_exit
    if not _ends_at_exit:
        from lit_dist.runtime.processes import end_helpers

        atexit.register(end_helpers)
        _ends_at_exit = True


def start_early(start: Start = "auto") -> None:
    """Start this process's fork server now (if workers will use one): its imports then overlap other work."""
    context(start)


# The commands whose data module may start loader workers.
LOADER_COMMANDS = ("fit", "validate", "test", "predict", "cache")


def server_for_command(argv: list[str]) -> Start | None:
    """The start method of ``lit-dist ARGV``'s loader workers if it will want a fork server for them, else None.
    Guessed from the command line and its ``--config`` files; a wrong guess costs only time (an idle server, or
    the start at the data module)."""
    if not argv or argv[0] not in LOADER_COMMANDS:
        return None
    try:
        workers, start = _workers_asked(argv[1:])
    except Exception:  # noqa: BLE001 - a config the real parse will report; the guess says nothing of it
        return None
    if workers == 0 or method(start) != "forkserver":
        return None
    return start


def can_fork_server() -> bool:
    """Whether this Python's fork server can be made a fork of this process (``fork_server_here``): the versions
    whose ``multiprocessing.forkserver`` this module knows, which are the ones where ``auto`` picks it."""
    return sys.version_info[:2] in ((3, 10), (3, 11))


def fork_server_here() -> bool:
    """Make this process's fork server a fork of this process, now: after its imports (the server and every
    worker forked from it share them) and before it starts a thread (with one other Python thread, the fork could
    deadlock as described above). Falls back to a server in a new interpreter (``start_early``) where another
    Python thread already runs. True if the server is a fork of this process."""
    for module in _PRELOAD[1:]:  # what workers unpickle: imported once, here, instead of in every worker
        importlib.import_module(module)
    if can_fork_server() and threading.active_count() == 1:
        try:
            return _fork_server()
        except OSError:  # no fork now (a process limit, no memory): the usual start, whose failure is reported as before
            pass
    start_early("forkserver")  # a no-op where a server runs already
    return False


def _fork_server() -> bool:
    """``fork_server_here``'s fork: True once multiprocessing knows the forked server as this process's."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        return False
    with _stop_signals_blocked():
        resource_tracker.ensure_running()  # workers report their semaphores to the rank's tracker, as before
    parent = os.getpid()
    # What ForkServer.ensure_running does, with os.fork() where it starts a new interpreter; without its lock,
    # which the server and its workers would inherit held (this is the only thread: nothing else can take it).
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # every client holds the write end: EOF ends the server
        try:
            util._flush_std_streams()  # or the server's workers would print what is buffered here again
            with _stop_signals_blocked():  # the mask goes through fork: server and workers keep it
                pid = os.fork()
                if pid == 0:
                    _serve(listener.fileno(), alive_r, alive_w, parent)
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, parent: int) -> None:
    """The forked fork server: multiprocessing's loop until every client is gone; never returns, and never runs
    the rank's exit handlers or flushes its buffers (``os._exit``)."""
    code = 1
    try:
        os.close(alive_w)
        from multiprocessing import forkserver

        from lit_dist.runtime.processes import die_with_parent

        die_with_parent(parent)
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:  # how forkserver.main ends once the rank is gone
        code = 0
    except BaseException as exc:  # noqa: BLE001 - one line, then the same exit as a spawned server's failure
        print(f"lit-dist: the loader workers' fork server of rank pid {parent} failed: {exc!r}", file=sys.stderr)
    finally:
        os._exit(code)


def _workers_asked(args: list[str]) -> tuple[int | None, str]:
    """``data.num_workers`` (None: not given, BucketDataModule's default, which starts workers) and
    ``data.worker_start`` from ``--config`` files and options, later ones winning as in the real parse; 0 workers
    for a data module other than BucketDataModule (the benchmarks' in-memory data)."""
    workers, start = None, "auto"
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if key == "--config":
            import yaml

            with open(value) as f:
                data = (yaml.safe_load(f) or {}).get("data")
            if isinstance(data, dict):
                other = "BucketDataModule" not in data.get("class_path", "BucketDataModule")
                data = data.get("init_args", data)
                workers = 0 if other else data.get("num_workers", workers)
                start = data.get("worker_start", start)
        elif key == "--data" and not value.endswith(("BucketDataModule", ".yaml", ".yml")):
            workers = 0
        elif key == "--data.num_workers":
            workers = int(value)
        elif key == "--data.worker_start":
            start = value
    return workers, start


def ignore_stop_signals(*_) -> None:
    """In a helper process (loader worker, pool worker): leave the stop signals to the training process, and
    end when its parent ends (a worker blocked in a read would never notice). Takes and ignores a worker id,
    to serve as a ``worker_init_fn`` or a pool's initializer."""
    from lit_dist.runtime.processes import die_with_parent

    die_with_parent()
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def quiet_handover_errors() -> None:
    """In a loader worker: say nothing when handing a batch to a training process fails because it has just died.
    A batch's shared memory travels as a file descriptor that multiprocessing's ``resource_sharer`` thread sends
    when the receiver asks; if the receiver is gone by then, that thread prints the ConnectionError's traceback
    itself (``sys.excepthook``), in the run's log, just before this worker ends with it. The rank left already
    says in one line which process died and how."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, (ConnectionError, EOFError)) and _through(tb, "multiprocessing/resource_sharer.py"):
            return
        previous(kind, value, tb)

    sys.excepthook = hook


def _through(tb, path: str) -> bool:
    """Whether a traceback passes through a file whose path ends with ``path``."""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith(path):
            return True
        tb = tb.tb_next
    return False


class QuietWorkerInit:
    """A DataLoader ``worker_init_fn``: ignore the stop signals (after PyTorch set its own SIGTERM handler in
    the worker, which would end it), then run ``inner`` (Lightning's worker seeding, say)."""

    def __init__(self, inner=None):
        from lit_dist.runtime.last_resort import WORKER_DUMPS_ENV

        self.inner = inner
        self.dumps = os.environ.get(WORKER_DUMPS_ENV)  # read in the rank, carried to the worker by pickle

    def __call__(self, worker_id: int) -> None:
        ignore_stop_signals()
        quiet_handover_errors()
        if self.dumps:  # the rank's hang watchdog asks for this worker's stacks when it dumps its own
            _dump_on_request(f"{self.dumps}-worker-pid-{os.getpid()}.txt")
        if self.inner is not None:
            self.inner(worker_id)


@contextlib.contextmanager
def reading(path: str):
    """Note ``path`` as the file this process reads until the block ends (a module variable: no I/O)."""
    global _reading
    _reading = path
    try:
        yield
    finally:
        _reading = None


def _dump_on_request(path: str) -> None:
    """Stacks from C at once (also while blocked), then the file being read, once a blocked system call is
    interrupted by the signal and Python runs its handler (a read stuck in the kernel's uninterruptible wait
    gives the stacks only)."""
    from lit_dist.runtime.last_resort import DUMP_SIGNAL, dump_on_request

    def say_reading(signum, frame):
        with open(path, "a") as f:
            f.write(f"\nreading: {_reading or 'no file'}\n")

    signal.signal(DUMP_SIGNAL, say_reading)
    dump_on_request(path)  # chained: faulthandler's dump first, then say_reading


def _start_server() -> None:
    """Start the fork server (and multiprocessing's resource tracker with it) if it is not running, with the
    stop signals blocked: the mask is inherited through fork and exec, so neither process, nor any worker
    forked from the server, is stopped by them. In this process they are only deferred, never lost."""
    from multiprocessing import forkserver, resource_tracker

    from lit_dist.runtime.orphan_guard import SERVER_ENV

    # The tracker first: starting it, multiprocessing unblocks SIGTERM again (it blocks SIGINT and SIGTERM
    # around its own spawn), which would leave the server without that block.
    with _stop_signals_blocked():
        resource_tracker.ensure_running()
    os.environ[SERVER_ENV] = str(os.getpid())  # the server's import of orphan_guard ties it to this process
    try:
        with _stop_signals_blocked():
            forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ENV]


@contextlib.contextmanager
def _stop_signals_blocked():
    # The mask is this thread's: other threads (and so the process) still take the signals meanwhile.
    numbers = {getattr(signal, name) for name in STOP_SIGNALS}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, numbers)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
