"""How a process of the run ended, said in one line: the children's return codes and PyTorch's errors about dead
loader workers (the whole runs are in tests/distributed/test_process_faults.py)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from lit_dist.errors import ExitCode
from lit_dist.runtime.processes import alive, how_it_ended, run_code, worker_death


def test_how_a_process_ended_names_its_signal_and_meaning_or_its_code():
    assert how_it_ended(-9).startswith("was killed by SIGKILL (what the kernel's out-of-memory killer sends")
    assert how_it_ended(-11).startswith("was killed by SIGSEGV")
    assert how_it_ended(3) == "ended with exit 3 (DATA_ERROR)"
    assert how_it_ended(77) == "ended with exit 77"
    assert run_code(-9) == ExitCode.PROCESS_DIED and run_code(12) == ExitCode.HUNG and run_code(77) == ExitCode.FAILURE


def test_pytorchs_dead_worker_errors_become_one_line_with_the_rank_and_the_signal():
    # The two errors PyTorch raises, the second chained from the first as in _try_get_data.
    killed = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")
    err = worker_death(killed, rank=1)
    assert err is not None and err.exit_code == ExitCode.PROCESS_DIED
    assert str(err).startswith("rank 1: data loader worker (pid 4242) was killed by SIGKILL")
    assert "data.num_workers" in str(err)
    try:
        try:
            raise killed
        except RuntimeError as inner:
            raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly") from inner
    except RuntimeError as outer:
        assert str(worker_death(outer, rank=0)).startswith("rank 0: data loader worker (pid 4242) was killed by SIGKILL")
    coded = RuntimeError("DataLoader worker (pid 7) exited unexpectedly with exit code 1. Details are lost")
    assert "(pid 7) ended with exit 1 (FAILURE)" in str(worker_death(coded, rank=0))
    assert worker_death(RuntimeError("Connection reset by peer"), rank=0) is None


@pytest.mark.process
def test_a_dead_workers_status_is_read_from_its_process_object_when_the_error_has_none():
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    process.start()
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    err = worker_death(RuntimeError(f"DataLoader worker (pid(s) {process.pid}) exited unexpectedly"), rank=2)
    assert f"(pid {process.pid}) was killed by SIGKILL" in str(err), err


@pytest.mark.process
def test_a_process_that_asked_to_die_with_its_parent_does(tmp_path):
    # parent -> child; the child asks, then the parent exits: the child must be gone, not orphaned.
    script = ("import os, sys, time; from lit_dist.runtime.processes import die_with_parent\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    die_with_parent(); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60); os._exit(0)\n"
              "while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read(): time.sleep(0.05)\n")
    marker = tmp_path / "child.pid"
    subprocess.run([sys.executable, "-c", script, str(marker)], check=True, timeout=30)
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.1)
    if alive(child):
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the child {child} outlived its parent")


@pytest.mark.process
@pytest.mark.parametrize("code, heard", [(ExitCode.STORAGE_FULL, True), (ExitCode.DATA_ERROR, False)])
def test_rank_0_ending_as_every_rank_does_lets_its_child_rank_say_its_line_first(code, heard):
    # Rank 0 ends its child ranks by ending (die_with_parent); a child a moment behind on the same way out (a full
    # disk's line of its own still to print) is waited for, one that may be stuck in a collective is not.
    script = ("import os, subprocess, sys; from lit_dist.runtime import processes\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import sys, time; from lit_dist.runtime.processes import "
              "die_with_parent; die_with_parent(int(sys.argv[1])); time.sleep(1.5); print(\"child: my line\", "
              "flush=True)', str(os.getpid())])\n"
              "processes.ChildRanks.current = processes.ChildRanks([child])\n"
              f"processes.let_children_finish({int(code)})\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("child: my line" in out.stdout) == heard, (out.stdout, time.monotonic() - start)



def test_a_collective_broken_by_a_peer_that_went_away_is_one_line_and_anything_else_is_not():
    from lit_dist.runtime.roll_call import peer_lost

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:34729: Connection reset by peer. "
                        "This is typically caused by a remote worker hanging")
    err = peer_lost(gloo, rank=0)
    assert err is not None and err.exit_code == ExitCode.PROCESS_DIED
    assert str(err).startswith("rank 0: a collective failed because another process of the run went away "
                               "(Connection reset by peer)")
    assert peer_lost(RuntimeError("CUDA out of memory"), rank=0) is None
    assert peer_lost(ValueError("Connection reset by peer"), rank=0) is None  # not a collective's error


@pytest.mark.process
def test_a_lit_dist_error_raised_in_a_loader_worker_reaches_the_user_as_its_own_message():
    import torch

    from lit_dist.errors import DataError

    def fail(_):
        raise DataError("the data is broken\n  - because of this")

    loader = torch.utils.data.DataLoader(range(2), num_workers=1, collate_fn=fail,
                                         multiprocessing_context="fork")
    try:
        next(iter(loader))
    except DataError as err:
        assert str(err) == "the data is broken\n  - because of this", str(err)  # not the worker's traceback
    else:
        raise AssertionError("no error")


@pytest.mark.process
def test_a_worker_killed_while_its_batch_is_handed_over_is_named_too():
    # Seen in a 2-rank run whose train worker was SIGKILLed: the batch's shared memory is fetched from the worker
    # over a socket, which the kernel resets as the worker dies. PyTorch names the worker only if it already knows
    # it is dead; a moment earlier (its fork server has not told this process yet) it raises the socket's error.
    import torch

    from lit_dist.reading.workers import context

    loader = torch.utils.data.DataLoader(range(4), batch_size=1, num_workers=1,
                                         multiprocessing_context=context("forkserver"))
    batches = iter(loader)
    worker = batches._workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    worker.is_alive = lambda: True  # what PyTorch's check saw, a moment before the end reached this process

    def reset(*args, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    batches._data_queue.get = reset
    with pytest.raises(ConnectionResetError) as caught:
        next(batches)
    err = worker_death(caught.value, rank=1)
    assert err is not None and err.exit_code == ExitCode.PROCESS_DIED, err
    assert str(err).startswith(f"rank 1: data loader worker (pid {worker.pid}) was killed by SIGKILL"), err
    assert worker_death(ConnectionResetError(104, "Connection reset by peer"), rank=1) is None  # not a loader's


@pytest.mark.process
def test_a_process_started_in_a_session_of_its_own_is_found_by_its_tag_and_killed():
    # torchrun starts each worker in a session of its own: the tests' check of what a run left behind went by the
    # run's session alone, and a hung plain_ddp rank outlived its benchmark unseen.
    from lit_dist.runtime.processes import tagged
    from tests.helpers.processes import left_after

    tag = ("LIT_DIST_TEST_RUN", f"t{os.getpid()}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                             env={**os.environ, tag[0]: tag[1]})
    try:
        # Between Popen's fork and the child's exec, /proc shows the parent's environment, without the tag: on a
        # loaded machine that window was still open when tagged() looked (seen once in CI).
        deadline = time.monotonic() + 10
        while tagged(*tag) != [child.pid] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tagged(*tag) == [child.pid]
        left = left_after(-1, 0.5, tag)  # no session: found by its tag alone
        assert child.pid in left and "time.sleep(600)" in left[child.pid], left
        assert child.wait(timeout=10) == -signal.SIGKILL  # left_after kills what it finds
        assert tagged(*tag) == []
    finally:
        child.kill()


_KILLED_WITH_A_SEMAPHORE = """
import multiprocessing, os, signal, sys
from lit_dist.runtime.processes import quiet_resource_tracker
if sys.argv[1] == "quiet":
    quiet_resource_tracker()
lock = multiprocessing.get_context("forkserver").Lock()  # a named semaphore, as loader queues have
print(lock._semlock.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a rank killed by the out-of-memory killer
"""


@pytest.mark.process
def test_what_a_killed_process_left_is_released_without_a_warning(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_WITH_A_SEMAPHORE)
    runs = {}
    for how in ("plain", "quiet"):
        # communicate() returns once the resource tracker, which shares stderr, has cleaned up and ended.
        runs[how] = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
        assert runs[how].returncode == -signal.SIGKILL
        name = runs[how].stdout.strip()
        assert name and not os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}"), "the semaphore was left"
    assert "leaked semaphore" in runs["plain"].stderr, runs["plain"].stderr  # what the tracker says unasked
    assert runs["quiet"].stderr == "", runs["quiet"].stderr
