"""The benchmarks' shared pieces (benchmarks/common.py) fail with a message, never hang or mislead."""

import sys
from types import SimpleNamespace

import pytest

from benchmarks import common


@pytest.mark.process
def test_a_hung_command_ends_with_its_stacks_and_leaves_no_process(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "COMMAND_TIMEOUT_S", 2)
    pidfile = tmp_path / "child.pid"
    # A launcher and the process it starts (as torchrun and its ranks), both waiting for ever.
    code = ("import subprocess, sys, time; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pidfile)!r}, 'w').write(str(child.pid)); time.sleep(600)")
    with pytest.raises(RuntimeError, match=r"hung for 2 s; its stacks:\n.*Fatal Python error: Aborted") as err:
        common.run_bench([sys.executable, "-c", code])
    assert str(err.value).count("Fatal Python error: Aborted") == 2, "both processes wrote their stacks"
    assert not _running(int(pidfile.read_text())), "the process the launcher started is left"


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_shorter_than_the_warm_up_says_that_it_timed_nothing():
    timer = common.StepTimer(warmup_steps=20)
    with pytest.raises(RuntimeError, match="ended after step 5, within its 20 warm-up steps: nothing was timed"):
        timer.on_train_end(SimpleNamespace(global_step=5, is_global_zero=True), None)


@pytest.mark.process
def test_a_failed_command_is_an_error_with_its_output():
    with pytest.raises(RuntimeError, match="failed:\n.*\nboom"):
        common.run_bench([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
