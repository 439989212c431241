"""``srun lit-dist preflight`` on the emulated three-node cluster (gloo, CPU matmul): a table per node and rank
and the all-reduce figures; a rank stopped six sevenths of the time (as a node with a failing part or a noisy
neighbour would be slowed) is named and the command exits 14."""

import json
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest

from lit_dist.errors import ExitCode
from tests.conftest import REPO, quickstart_args

# It compares the ranks' speeds against each other: with other tests beside it, a busy core looks like a slow rank.
pytestmark = pytest.mark.serial

FLAGS = ["--data.batch_size_per_device", "8", "--data.num_workers", "0", "--preflight.seconds", "1",
         "--preflight.io_mb", "8", "--preflight.allreduce_mb", "4"]


def _preflight(env, tmp_path, demo_data, run_id: str, *extra: str):
    """The job, started; its stdout goes to ``tmp_path / f"{run_id}.out"`` (read while it runs)."""
    with open(tmp_path / f"{run_id}.out", "w") as out:
        return subprocess.Popen(["srun", "-N3", "--ntasks-per-node=1", env["LIT_DIST"], "preflight",
                                 *quickstart_args(tmp_path, demo_data, run__run_id=run_id), *FLAGS, *extra],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.PIPE, text=True)


def _ended(proc, tmp_path, run_id: str, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of the job once it ends."""
    _, err = proc.communicate(timeout=timeout)
    return (tmp_path / f"{run_id}.out").read_text(), err


def _rank_pid(run_id: str, rank: int) -> int | None:
    for proc in psutil.process_iter(["cmdline", "environ"]):
        environ, cmdline = proc.info["environ"] or {}, " ".join(proc.info["cmdline"] or [])
        if environ.get("SLURM_PROCID") == str(rank) and "preflight" in cmdline and run_id in cmdline:
            return proc.pid
    return None


def test_preflight_measures_every_rank_and_node_and_names_a_starved_rank(slurm_nodes, tmp_path, demo_data):
    env, _ = slurm_nodes
    # Three ranks share two cores here, and reading the demo's small files is CPU work: a rank descheduled for part
    # of its one-second window once read 0.17 x the median (a clean-clone CI run). Nothing is starved in this run.
    proc = _preflight(env, tmp_path, demo_data, "even", "--preflight.min_fraction", "0.1")
    out, err = _ended(proc, tmp_path, "even", timeout=240)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "lit-dist preflight: measuring 3 ranks" in out and "lit-dist preflight: 3 ranks on 3 nodes" in out, out[-2000:]
    assert "all-reduce, whole job (3 ranks):" in out and "GB/s bus bandwidth" in out
    report = json.loads((tmp_path / "quickstart" / "even" / "preflight.json").read_text())
    assert [r["node"] for r in report["ranks"]] == ["node1", "node2", "node3"]
    for figures in report["ranks"]:
        assert all(figures[k] > 0 for k in ("matmul_tflops", "read_mb_s", "write_mb_s", "loader_images_s")), figures
    assert report["job_busbw_gb_s"] > 0 and report["outliers"] == []
    assert not list((tmp_path / "quickstart" / "even" / "checkpoints").glob(".preflight-*")), "its files are removed"

    proc = _preflight(env, tmp_path, demo_data, "starved", "--preflight.min_fraction", "0.6")
    stop = threading.Event()

    report = tmp_path / "quickstart" / "starved" / "preflight.json"

    def starve() -> None:  # 180 ms stopped, 30 ms running, from the start of the measurements to the report
        # Not through its start-up or its exit: starved from its start, a rank took a minute to begin; kept at a
        # seventh of a core after its report was written, one once outlasted the test's 300 s (a clean-clone CI run).
        pid = None
        while (pid is None or "measuring" not in (tmp_path / "starved.out").read_text()) and not stop.is_set():
            pid = pid or _rank_pid("starved", 2)
            time.sleep(0.05)
        while not stop.is_set() and not report.exists():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.18)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.03)
            except ProcessLookupError:
                return

    thread = threading.Thread(target=starve, daemon=True)
    thread.start()
    try:
        out, err = _ended(proc, tmp_path, "starved", timeout=300)
    finally:
        stop.set()
        thread.join()
    assert proc.returncode == ExitCode.PREFLIGHT, out[-2000:] + err[-3000:]
    report = json.loads(report.read_text())
    named = "; ".join(report["outliers"])
    assert "rank 2 (node3) matmul" in named and "rank 2 (node3) loader" in named, named
    # The others' compute is not named (their I/O may be: three ranks share one disk and two cores here).
    assert not [o for o in report["outliers"] if o.startswith(("rank 0", "rank 1")) and ("matmul" in o or "loader" in o)]
    assert "lit-dist: error: preflight: below 0.6 x the median: rank 2 (node3)" in err, err[-2000:]
