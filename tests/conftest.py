"""Shared fixtures. Tiers are markers (see pyproject.toml); unmarked tests are ``unit`` and run in pytest's own
process. A test that starts any process (``lit_dist`` below, subprocess, fork, loader workers, a tool) is
marked ``process``, or ``distributed`` for several ranks."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from lit_dist.runtime import compat
from lit_dist.runtime.processes import tagged

# In-process trainers get the console the lit-dist command line sets up (TQDM and the plain model summary, with
# or without rich installed).
compat.plain_console()

# Before any helper is imported: then a failed assert in tests/helpers/ shows its operands, as in a test module.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import schedule  # noqa: E402
from tests.helpers.processes import left_after, session_processes  # noqa: E402
from tests.helpers.zygote import SWITCH_ENV as ZYGOTE_SWITCH  # noqa: E402
from tests.helpers.zygote import Zygote  # noqa: E402

RUN_TAG_ENV = "LIT_DIST_TEST_RUN"  # in the environment of every process a test's run starts
LEFT_BOUND_S = 10.0  # docs/slurm.md, "A rank that hangs": every process of a run is gone this long after the job exits
REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"


def pytest_configure(config):
    config.pluginmanager.register(schedule.Order(), "lit-dist-order")
    if hasattr(config, "workerinput") and "OMP_NUM_THREADS" not in os.environ:
        # One intra-op thread per xdist worker, as .ci/test sets for all: torch's default of one per core in every
        # worker at once made `-m unit -n 2` 2.6x slower on 2 cores (182 s against 70 s), slower than no -n at all.
        import torch

        torch.set_num_threads(1)
    if os.environ.get(schedule.RECORD_ENV) == "1" and not hasattr(config, "workerinput"):  # xdist's workers report here
        config.pluginmanager.register(schedule.Recorder(), "lit-dist-durations")


def pytest_collection_modifyitems(items):
    # The modules that hold a slow test first, each module's tests together (its fixtures are made once); in
    # several workers (.ci/test), tests/helpers/schedule.py then lays out what -m and -k selected.
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)
    tiers = {"distributed", "slurm", "s3", "gpu", "process"}
    for item in items:
        tier = tiers & set(item.keywords)
        if not tier:
            item.add_marker(pytest.mark.unit)
        elif any(mark.name == "unit" for mark in item.iter_markers()):
            # `-m unit` would select it: a module-level `pytestmark = pytest.mark.unit` over a process test.
            raise pytest.UsageError(f"{item.nodeid} is marked unit and {', '.join(sorted(tier))}: one tier only")


@pytest.fixture(autouse=True)
def _no_cluster_env(monkeypatch):
    # With SLURM_* or torchrun variables around, Lightning would pick that cluster environment
    # for in-process tests too, and the run id would follow the outer job.
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "PL_")) or name in ("LIT_DIST_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small demo dataset (400 images) made once per test session; returns the metadata path."""
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path_factory.mktemp("demo") / "shapes" / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=400, seed=0)
    return path


def lit_dist(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
             launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the real ``lit-dist`` command line in a subprocess, as a user would (``launcher``: the command that
    runs ``-m lit_dist ...`` in its place, e.g. torchrun and its flags; default: this Python)."""
    return run_module("lit_dist", *args, cwd=cwd, timeout=timeout, env=env, launcher=launcher)


def run_module(module: str, *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """``python -m module args`` (``lit_dist``, a benchmark) as a user runs it; on a hang, the stacks of its
    processes; fails the test if any of them outlives it."""
    clean = _run_env()
    # Every process of the run carries the tag, also those a launcher starts in sessions of their own (torchrun).
    tag = (RUN_TAG_ENV, uuid.uuid4().hex)
    clean[tag[0]] = tag[1]
    clean.update(env or {})
    name = "lit-dist" if module == "lit_dist" else module
    zygote = warm_process()
    if zygote is not None and zygote.can_run(clean, launcher):  # a fork of this session's warm process: the same run without its 4 s of import
        pid, code, stdout, stderr, hung = zygote.run(module, list(args), clean, str(cwd or REPO), timeout,
                                                     lambda pid, sig: _signal_run(pid, tag, sig))
        if hung:
            pytest.fail(f"`{name} {' '.join(args)}` hung for {timeout} s; the stacks of its processes:\n{stderr[-20000:]}")
        done = subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, stdout, stderr)
        return _no_leftovers(done, pid, name, args, tag)
    # Its own session: on a hang, every process of the run (ranks, loader workers) can be reached at once.
    proc = subprocess.Popen([*(launcher or [sys.executable]), "-m", module, *args], cwd=cwd or REPO, env=clean, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_run(proc.pid, tag, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_run(proc.pid, tag, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"`{name} {' '.join(args)}` hung for {timeout} s; the stacks of its processes:\n{stderr[-20000:]}")
    return _no_leftovers(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), proc.pid, name, args, tag)


def start_module(module: str, *args: str, cwd: Path | None = None, env: dict | None = None):
    """``python -m module args`` running, for a test that acts on it while it runs: a ``subprocess.Popen`` with
    stdout and stderr piped in text mode, in a session of its own, or the same forked from this session's warm
    process (``tests.helpers.zygote.WarmRun``) where it can be. The test ends it (``tests.helpers.processes``)."""
    clean = _run_env()
    clean.update(env or {})
    zygote = warm_process()
    if zygote is not None and zygote.can_run(clean, None):
        return zygote.start(module, list(args), clean, str(cwd or REPO))
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd or REPO, env=clean, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _run_env() -> dict:
    """This process's environment as a run started by a test gets it (then its tag and the test's ``env``)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k != "LIT_DIST_RUN_ID"}
    clean["PYTHONFAULTHANDLER"] = "1"  # a process killed by SIGABRT first writes every thread's stack
    return clean


def _no_leftovers(done: subprocess.CompletedProcess, pid: int, name: str, args, tag) -> subprocess.CompletedProcess:
    done.pid = pid  # its session's id: tests.helpers.processes finds what the run left behind by it
    if left := left_after(pid, LEFT_BOUND_S, tag):  # whatever the exit, nothing of the run may remain
        pytest.fail(f"`{name} {' '.join(args)}` exited {done.returncode} and left {len(left)} processes "
                    f"{LEFT_BOUND_S:.0f} s later: {left}\n{done.stderr[-3000:]}")
    return done


_ZYGOTE: list = []  # this pytest process's warm process (tests/helpers/zygote.py), once started; None if it failed


def warm_process() -> Zygote | None:
    """This pytest process's warm process (started on first use, with this process's environment as a run gets
    it), or None where there is none: runs start as new interpreters."""
    if not _ZYGOTE:
        if threading.current_thread() is not threading.main_thread():
            return None  # its parent must be a thread that lasts: it dies with the one that started it
        env = _run_env()
        try:
            _ZYGOTE.append(Zygote(env) if env.get(ZYGOTE_SWITCH, "1") != "0" else None)
        except OSError:
            _ZYGOTE.append(None)
    return _ZYGOTE[0]


def pytest_unconfigure(config):
    if _ZYGOTE and _ZYGOTE[0] is not None:
        _ZYGOTE[0].close()


def _signal_run(sid: int, tag: tuple[str, str], sig: int) -> None:
    """``sig`` to every process of a run: its session, and whatever carries its tag elsewhere."""
    for pid in {*session_processes(sid), *tagged(*tag)}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def quickstart_args(root_dir: Path | None = None, metadata: Path | None = None, *configs: Path, **overrides) -> list[str]:
    """The quickstart's command line without its subcommand: configs/quickstart.yaml, then ``configs`` layered on
    it, the run directory under ``root_dir`` and the table ``metadata`` (e.g. the demo_data fixture), then each
    override as a dotted flag: ``trainer__max_epochs=1`` -> ``--trainer.max_epochs 1`` (True/False/None as
    true/false/null)."""
    args = [a for c in (CONFIGS / "quickstart.yaml", *configs) for a in ("--config", str(c))]
    if metadata is not None:
        args += ["--data.metadata", str(metadata)]
    if root_dir is not None:
        args += ["--run.root_dir", str(root_dir)]
    for key, value in overrides.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        args += [f"--{key.replace('__', '.')}", text]
    return args
