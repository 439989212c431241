"""The benchmarks' shared pieces (benchmarks/common.py) fail with a message, never hang or mislead."""

import sys
from types import SimpleNamespace

import pytest

from benchmarks import common
from lit_dist.runtime.processes import alive


@pytest.mark.process
@pytest.mark.parametrize("own_session", [False, True], ids=["same-session", "own-session"])
def test_a_hung_command_ends_with_its_stacks_and_leaves_no_process(own_session, monkeypatch, tmp_path):
    # Long enough for both interpreters to start on a loaded 2-core CI machine: a child killed before its
    # faulthandler is installed writes no stacks (seen once in CI with 2 s and no hand-shake).
    monkeypatch.setattr(common, "COMMAND_TIMEOUT_S", 6)
    pidfile, ready = tmp_path / "child.pid", tmp_path / "child.ready"
    # A launcher and the process it starts (as torchrun and its ranks, each in a session of its own: a signal to
    # the launcher's group did not reach them, and a hung plain_ddp rank outlived bench_ddp's short run in a
    # suite), both waiting for ever; the launcher waits until its child runs Python code (its faulthandler is on
    # by then).
    child = f"import time; open({str(ready)!r}, 'w'); time.sleep(600)"
    code = ("import os, subprocess, sys, time; "
            f"child = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session={own_session}); "
            f"[time.sleep(0.01) for _ in iter(lambda: os.path.exists({str(ready)!r}), True)]; "
            f"open({str(pidfile)!r}, 'w').write(str(child.pid)); time.sleep(600)")
    with pytest.raises(RuntimeError, match=r"hung for 6 s; its stacks:\n.*Fatal Python error: Aborted") as err:
        common.run_bench([sys.executable, "-c", code])
    assert str(err.value).count("Fatal Python error: Aborted") == 2, "both processes wrote their stacks"
    assert not alive(int(pidfile.read_text())), "the process the launcher started is left"


def test_a_run_shorter_than_the_warm_up_says_that_it_timed_nothing():
    timer = common.StepTimer(warmup_steps=20)
    with pytest.raises(RuntimeError, match="ended after step 5, within its 20 warm-up steps: nothing was timed"):
        timer.on_train_end(SimpleNamespace(global_step=5, is_global_zero=True), None)


@pytest.mark.process
def test_a_failed_command_is_an_error_with_its_output():
    with pytest.raises(RuntimeError, match="failed \\(exit 3\\):\n.*\nboom"):
        common.run_bench([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])


@pytest.mark.process
def test_a_hung_command_forked_from_the_warm_process_ends_with_its_stacks(monkeypatch):
    """LIT_DIST_BENCH_WARM=1 (the tests' short runs): a python -m command runs as a fork of the benchmark's warm
    process (its stack shows it), and a hang there ends as one in a new interpreter does."""
    monkeypatch.setenv(common.WARM_ENV, "1")
    monkeypatch.setattr(common, "_WARM", [])
    monkeypatch.setattr(common, "COMMAND_TIMEOUT_S", 6)
    try:
        with pytest.raises(RuntimeError, match=r"hung for 6 s; its stacks:\n.*Fatal Python error: Aborted") as err:
            common.run_bench([sys.executable, "-m", "timeit", "-n", "1", "-r", "1", "import time; time.sleep(600)"])
        assert "zygote.py" in str(err.value), "not forked from the warm process"
        assert common.command([sys.executable, "-m", "platform"]).stdout.strip(), "a forked command's output"
    finally:
        common._WARM[0].close()
