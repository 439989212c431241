"""The tests' warm process (tests/helpers/zygote.py): a run forked from it is the run a new interpreter would be."""

import json
import os
import signal
import subprocess

import pytest

from tests.conftest import REPO, run_module, start_module, warm_process

pytestmark = pytest.mark.process


@pytest.mark.parametrize("how", ["0", "3", "kill", "raise"])
def test_a_forked_run_is_what_a_new_interpreter_runs(how, tmp_path):
    env = {"AS_MAIN": "mine", "TMPDIR": str(tmp_path)}
    warm = run_module("tests.helpers.as_main", how, env=env)
    new = run_module("tests.helpers.as_main", how, env={**env, "LIT_DIST_TEST_ZYGOTE": "0"})
    seen = [json.loads(out.stdout.splitlines()[0]) for out in (warm, new)]
    assert seen[0]["ppid"] != seen[1]["ppid"], "both runs started as new interpreters: no warm process was used"
    # SIGINT: Python's handler, or ignored in both where this session was started with it ignored (a background job).
    sigint = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    for run, out in zip(seen, (warm, new), strict=True):
        assert run["sid"] == run["pid"] == out.pid  # a session of its own, as start_new_session makes
        assert run["env"] == "mine" and run["sigint"] is sigint
    for key in ("argv", "cwd", "path0", "main_spec", "spawn_main", "tmp"):
        assert seen[0][key] == seen[1][key], key
    assert seen[0]["tmp"] == str(tmp_path) and seen[0]["cwd"] == str(REPO) and seen[0]["main_spec"] == "tests.helpers.as_main"
    assert warm.returncode == new.returncode == {"kill": -signal.SIGKILL, "raise": 1}.get(how, int(how if how.isdigit() else 0))
    assert warm.stdout == new.stdout.replace(str(seen[1]["pid"]), str(seen[0]["pid"])).replace(
        f'"ppid": {seen[1]["ppid"]}', f'"ppid": {seen[0]["ppid"]}').replace(f'"sid": {seen[1]["sid"]}', f'"sid": {seen[0]["sid"]}')
    # The same stream, "\r\n" read as "\n"; a bug's traceback differs only in the frames above the module's own.
    assert warm.stderr.startswith("to stderr\nline\n")
    if how == "raise":
        assert warm.stderr.splitlines()[-3:] == new.stderr.splitlines()[-3:] and "Traceback" in warm.stderr
        assert warm.stderr.endswith("RuntimeError: a bug\n")
    else:
        assert warm.stderr == new.stderr


def test_a_run_that_sets_what_is_read_at_import_is_a_new_interpreter():
    out = run_module("tests.helpers.as_main", "0", cwd=REPO, env={"OMP_NUM_THREADS": "7"})
    warm = run_module("tests.helpers.as_main", "0", cwd=REPO)
    assert json.loads(out.stdout.splitlines()[0])["ppid"] != json.loads(warm.stdout.splitlines()[0])["ppid"]


def test_a_forked_run_that_hangs_shows_its_stacks():
    zygote = warm_process()
    assert zygote is not None
    pid, code, stdout, stderr, hung = zygote.run("tests.helpers.as_main", ["hang"], dict(zygote.env), str(REPO), 3,
                                                 os.killpg)
    assert hung and code == -signal.SIGABRT, (code, stderr)
    assert "in <module>" in stderr and "as_main.py" in stderr  # the faulthandler's stack of the hung line



@pytest.mark.parametrize("how", ["3", "hang"])
def test_a_started_run_is_held_as_popen_holds_one(how):
    """start_module: what a test that acts on a running run uses of Popen (streams, poll, wait, communicate with a
    timeout and again, signals to its session) is the same for a forked run as for a new interpreter."""
    runs = [start_module("tests.helpers.as_main", how), start_module("tests.helpers.as_main", how,
                                                                      env={"LIT_DIST_TEST_ZYGOTE": "0"})]
    assert not isinstance(runs[0], subprocess.Popen) and isinstance(runs[1], subprocess.Popen)
    for run in runs:
        seen = json.loads(run.stdout.readline())
        assert seen["sid"] == seen["pid"] == run.pid
        if how == "hang":
            assert run.poll() is None
            with pytest.raises(subprocess.TimeoutExpired):
                run.wait(0.2)
            with pytest.raises(subprocess.TimeoutExpired):
                run.communicate(timeout=0.2)
            os.killpg(run.pid, signal.SIGKILL)
        out, err = run.communicate(timeout=30)
        assert (run.returncode, out, err) == (-signal.SIGKILL if how == "hang" else 3, "", "to stderr\nline\n")
        assert run.poll() == run.wait() == run.returncode
