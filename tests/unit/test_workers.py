"""How loader workers start (lit_dist.reading.workers): fork only where CPython forks a threaded process safely."""

import multiprocessing
import os
import sys

import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError
from lit_dist.reading import workers
from tests.conftest import REPO


@pytest.mark.parametrize(("version", "safe"), [
    ((3, 10, 14), False), ((3, 10, 15), True), ((3, 11, 7), False), ((3, 11, 9), False), ((3, 11, 10), True),
    ((3, 12, 0), True), ((3, 13, 1), True),
])
def test_fork_is_used_only_on_pythons_with_the_thread_state_lock_fix(version, safe):
    assert workers.fork_is_safe(version) is safe


def test_auto_means_fork_or_forkserver_by_this_python_and_explicit_choices_stay():
    assert workers.method("auto") == ("fork" if workers.fork_is_safe() else "forkserver")
    for start in ("fork", "forkserver", "spawn"):
        assert workers.method(start) == start
    with pytest.raises(ConfigError, match=r"data.worker_start = 'thread': must be one of auto, fork, forkserver, spawn"):
        BucketDataModule(metadata="m.parquet", worker_start="thread")


def _batches(dm: BucketDataModule, split: str) -> list[dict]:
    loader = dm.val_dataloader() if split == "val" else dm.train_dataloader()
    return [batch for _, batch in zip(range(3), loader, strict=False)]


@pytest.mark.process
def test_forkserver_workers_serve_the_batches_fork_workers_serve_from_a_single_threaded_server(demo_data):
    made = {}
    for start in ("fork", "forkserver"):
        dm = BucketDataModule(metadata=str(demo_data), batch_size_per_device=8, resolution=32, num_workers=2,
                              worker_start=start, cache=None)
        dm.setup("fit")
        made[start] = {split: _batches(dm, split) for split in ("train", "val")}
        if start == "forkserver":
            loader = dm.val_dataloader()
            assert loader.multiprocessing_context.get_start_method() == "forkserver"
            # The server forks every worker: it must have no thread that could hold a lock at fork.
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            assert server is not None
            assert len(os.listdir(f"/proc/{server}/task")) == 1, os.listdir(f"/proc/{server}/task")
    for split in ("train", "val"):
        for a, b in zip(made["fork"][split], made["forkserver"][split], strict=True):
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    assert torch.equal(a[key], b[key]), (split, key)
                else:
                    assert a[key] == b[key], (split, key)


@pytest.mark.process
@pytest.mark.skipif(workers.fork_is_safe(), reason="this Python forks threaded processes safely")
def test_on_this_python_a_data_module_starts_its_fork_server_when_it_is_made(demo_data):
    import subprocess

    code = ("import multiprocessing.forkserver as f; from lit_dist.data.datamodule import BucketDataModule; "
            f"BucketDataModule(metadata={str(demo_data)!r}, num_workers=1, cache=None); "
            "print(f._forkserver._forkserver_pid is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


@pytest.mark.parametrize(("args", "asked"), [
    (["--config", "configs/quickstart.yaml"], (1, "auto")),
    (["--config", "configs/quickstart.yaml", "--data.num_workers", "0"], (0, "auto")),
    (["--config", "configs/quickstart.yaml", "--data.num_workers=3", "--data.worker_start", "spawn"], (3, "spawn")),
    (["--config", "configs/quickstart.yaml", "--data", "benchmarks.common.InMemoryData"], (0, "auto")),
    (["--config", "configs/ddp.yaml"], (None, "auto")),  # no data section: BucketDataModule's default
])
def test_the_workers_a_command_line_asks_for_are_read_from_its_configs_and_options(args, asked):
    assert workers._workers_asked(args) == asked


def test_a_data_module_left_at_its_defaults_starts_workers_as_the_early_start_assumes():
    import inspect

    assert inspect.signature(BucketDataModule).parameters["num_workers"].default > 0


@pytest.mark.process
@pytest.mark.skipif(workers.fork_is_safe(), reason="this Python forks threaded processes safely")
@pytest.mark.parametrize(("command", "started"), [
    ("fit --config configs/quickstart.yaml", True), ("fit --config configs/quickstart.yaml --data.num_workers 0", False),
    ("cache --config configs/t2i_quickstart.yaml", True), ("report runs/x", False), ("fit --config missing.yaml", False),
])
def test_the_early_start_of_a_fork_server_is_for_the_commands_that_want_workers_and_before_lightning(command, started):
    import subprocess

    # What lit_dist/__main__.py does before its imports where the server cannot be a fork of the rank.
    code = ("import sys, multiprocessing.forkserver as f; from lit_dist.reading import workers; "
            f"start = workers.server_for_command({command.split()!r}); start is None or workers.start_early(start); "
            "print(f._forkserver._forkserver_pid is not None, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(started), "False"]


_SERVER_OF_THIS_PROCESS = """
import os, sys, threading, time
import multiprocessing.forkserver as f
import torch  # as the rank has imported it by then
from lit_dist.reading import workers


def send_parent(conn):
    conn.send(os.getppid())


if __name__ == "__main__":
    if sys.argv[1] == "thread":  # another Python thread runs: a fork could deadlock on this Python
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    forked = workers.fork_server_here()
    server = f._forkserver._forkserver_pid
    ctx = workers.context("forkserver")
    mine, theirs = ctx.Pipe()
    worker = ctx.Process(target=send_parent, args=(theirs,))
    worker.start()
    parent = mine.recv()
    worker.join()
    with open(f"/proc/{server}/cmdline") as a, open("/proc/self/cmdline") as b:
        print(forked, parent == server, a.read() == b.read())
"""


@pytest.mark.process
@pytest.mark.skipif(not workers.can_fork_server(), reason="this Python's fork server is always a new interpreter")
@pytest.mark.parametrize(("threads", "forked"), [("none", True), ("thread", False)])
def test_the_fork_server_is_a_fork_of_the_rank_unless_another_thread_runs(tmp_path, threads, forked):
    # A fork shares the rank's imports (its command line is the rank's); a new interpreter imports them again.
    # Either ends with the process that made it.
    import subprocess

    from tests.helpers.processes import finish, left_after

    script = tmp_path / "server.py"
    script.write_text(_SERVER_OF_THIS_PROCESS)
    proc = subprocess.Popen([sys.executable, str(script), threads], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, err[-3000:]
    assert out.split() == [str(forked), "True", str(forked)], err[-3000:]
    assert left_after(proc.pid, 10) == {}


_SIGNALLED_LOADER = """
import os, signal, sys
from lit_dist.data.datamodule import BucketDataModule

if __name__ == "__main__":  # workers not forked from this process import it
    received = []
    for name in ("SIGUSR1", "SIGTERM"):  # the training process takes them, as Preemption does
        signal.signal(getattr(signal, name), lambda number, frame: received.append(signal.Signals(number).name))
    dm = BucketDataModule(metadata=sys.argv[1], batch_size_per_device=8, resolution=96, num_workers=2,
                          worker_start=sys.argv[2], cache=None)
    dm.setup("fit")
    batches = 0
    for batch in dm.train_dataloader():
        batches += 1
        if batches == 2:  # a batch here is ~0.9 MB, well over a pipe's buffer: workers are mid-send
            os.killpg(0, signal.SIGUSR1)  # as Slurm signals every process of the job step
            os.killpg(0, signal.SIGTERM)
    print(batches, sorted(received))
"""


@pytest.mark.process
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_stop_signals_sent_to_every_process_leave_the_loader_serving_to_the_end(demo_data, tmp_path, start):
    import subprocess

    script = tmp_path / "loader.py"
    script.write_text(_SIGNALLED_LOADER)
    out = subprocess.run([sys.executable, str(script), str(demo_data), start], capture_output=True, text=True,
                         timeout=120, start_new_session=True)
    assert out.returncode == 0, out.stderr[-3000:]
    batches, signals = out.stdout.split(" ", 1)
    assert int(batches) > 2 and signals.strip() == "['SIGTERM', 'SIGUSR1']", out.stdout
    # A resource tracker that died of the signal is restarted and prints KeyError tracebacks at exit.
    assert "Traceback" not in out.stderr and "resource_tracker" not in out.stderr, out.stderr[-3000:]


_ALIVE_AT_EXIT = """
import sys, torch
from torch.utils.data import DataLoader
from lit_dist.reading.workers import QuietWorkerInit, context
kept = []
if __name__ == "__main__":
    loader = DataLoader(list(range(100)), batch_size=4, num_workers=2, worker_init_fn=QuietWorkerInit(),
                        multiprocessing_context=context(sys.argv[1]))
    batches = iter(loader)
    next(batches)
    kept.append(batches)  # alive at exit, as a loader held by an exception's reference cycle is
    print("exiting", flush=True)
"""


@pytest.mark.process
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_process_exits_with_a_loader_still_alive(tmp_path, start):
    # Its workers ignore SIGTERM (the stop signals are the training process's): multiprocessing's exit handler, which
    # ends daemonic children with SIGTERM and then joins them, waited for ever before lit-dist ended them itself.
    import subprocess

    script = tmp_path / "alive_at_exit.py"
    script.write_text(_ALIVE_AT_EXIT)
    proc = subprocess.run([sys.executable, str(script), start], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 0 and "exiting" in proc.stdout, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


_HANDOVER = """
import os, sys, threading
from multiprocessing import connection, process, resource_sharer
from lit_dist.reading.workers import QuietWorkerInit
if sys.argv[1] == "quiet":
    QuietWorkerInit()(0)
for _ in range(3):  # the receiver asks for the descriptor, then dies before it arrives
    read, write = os.pipe()
    address, key = resource_sharer.DupFd(read)._id
    gone = threading.Event()
    send, close = resource_sharer._resource_sharer._cache[key]
    def send_once_gone(conn, pid, send=send, gone=gone):  # the order a dying receiver makes, every time
        gone.wait(10)
        send(conn, pid)
    resource_sharer._resource_sharer._cache[key] = (send_once_gone, close)
    asking = connection.Client(address, authkey=process.current_process().authkey)
    asking.send((key, os.getpid()))
    asking.close()
    gone.set()
    os.close(write)
resource_sharer.stop(timeout=5)
print("handed over", file=sys.stderr)
"""


@pytest.mark.process
def test_a_worker_handing_a_batch_to_a_process_that_died_says_nothing(tmp_path):
    import subprocess

    script = tmp_path / "handover.py"
    script.write_text(_HANDOVER)
    runs = {how: subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
            for how in ("plain", "quiet")}
    assert "BrokenPipeError" in runs["plain"].stderr or "ConnectionResetError" in runs["plain"].stderr, \
        runs["plain"].stderr[-2000:]  # what the scene makes without the worker's hook
    assert "handed over" in runs["quiet"].stderr and "Traceback" not in runs["quiet"].stderr, runs["quiet"].stderr
