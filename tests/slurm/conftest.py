"""A real single-node Slurm cluster for the ``slurm`` tests, started once per session (tests/slurm/cluster.py)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm import cluster


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/slurm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.slurm)  # one cluster per machine: .ci/test runs them in one process


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The clients' environment (SLURM_CONF) of a running one-node cluster."""
    problem = cluster.install()
    if problem:
        pytest.skip(problem)
    folder = tmp_path_factory.mktemp("slurm-cluster")
    env = cluster.start(folder, nodes=1)
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    # Jobs run the checkout's lit-dist, with the tests' helpers importable.
    env.update(PYTHONPATH=str(REPO), LIT_DIST=str(Path(sys.executable).parent / "lit-dist"))
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        cluster.stop(folder)


@pytest.fixture(scope="session")
def slurm_nodes(tmp_path_factory):
    """(clients' environment, cluster folder) of a running three-node cluster emulated with network namespaces
    (the multi-node tests use two; node exclusion needs a third to go to)."""
    problem = cluster.install()
    if problem:
        pytest.skip(problem)
    if not all(shutil.which(tool) for tool in ("ip", "nsenter", "unshare")):
        pytest.skip("emulating nodes needs ip, nsenter and unshare")
    folder = tmp_path_factory.mktemp("slurm-nodes")
    try:
        env = cluster.start(folder, nodes=3)
    except Exception:
        cluster.stop(folder)
        raise
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(PYTHONPATH=str(REPO), LIT_DIST=str(Path(sys.executable).parent / "lit-dist"), GLOO_SOCKET_IFNAME="eth0")
    try:
        yield env, folder
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        cluster.stop(folder)


def job_fields(env: dict, job: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(env: dict, job: str, states: set[str], timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        fields = job_fields(env, job)
        if fields.get("JobState") in states:
            return fields
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} not in {states} after {timeout_s} s: {fields}")
        time.sleep(0.2)


def sbatch(env: dict, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]
