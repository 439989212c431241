"""lit-dist under a real Slurm cluster: the sbatch template, allocation checks, preemption and
requeue with an exact resume, and a rank killed outright."""

import os
import re
import signal
import subprocess
import time

import psutil
import torch

from tests.conftest import REPO, quickstart_args
from tests.slurm.conftest import sbatch, wait_for

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def extra(demo_data, epochs: int) -> str:
    return (f"--data.metadata {demo_data} --data.batch_size_per_device 8 --data.num_workers 0 "
            f"--trainer.max_epochs {epochs} --trainer.enable_progress_bar false "
            "--model.net.class_path tests.helpers.nets.DropoutCNN")


def submit(env, tmp_path, demo_data, epochs, name="quickstart") -> str:
    # The template's slurm-%j.out would land in the repository, the submission folder; Slurm
    # does not create the folder of --output.
    tmp_path.mkdir(parents=True, exist_ok=True)
    return sbatch(env, f"--export=ALL,ROOT={tmp_path},NAME={name},EXTRA={extra(demo_data, epochs)}",
                  f"--output={tmp_path}/slurm-%j.out", "slurm/cpu.sbatch")


def test_sbatch_cpu_template_trains_the_quickstart_on_two_tasks(slurm, tmp_path, demo_data):
    job = submit(slurm, tmp_path, demo_data, epochs=2)
    fields = wait_for(slurm, job, DONE)
    run_dir = tmp_path / "quickstart" / f"slurm-{job}"
    log = (run_dir / "slurm.log").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-3000:]
    assert "trainer.devices 2 (Slurm tasks per node)" in log
    assert "lit-dist: fit finished" in log and (run_dir / "model.pt").exists()
    assert list((run_dir / "checkpoints").glob("step-*/COMPLETE.json"))


def test_a_mismatched_allocation_is_refused_in_seconds(slurm, tmp_path, demo_data):
    started = time.monotonic()
    out = subprocess.run(["srun", "-N1", "--ntasks-per-node=2", slurm["LIT_DIST"], "fit",
                          *quickstart_args(tmp_path, trainer__devices=1), *extra(demo_data, 1).split()],
                         cwd=REPO, env=slurm, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "trainer.devices: 1 but Slurm runs 2 tasks per node (--ntasks-per-node)" in out.stderr
    # The behaviour under test: refused at start-up, not after a hang; 60 s is room for a loaded machine.
    assert took < 60, f"refused after {took:.0f} s"
    assert not (tmp_path / "quickstart").exists() or not list((tmp_path / "quickstart").rglob("step-*"))


def test_usr1_saves_requeues_and_the_restarted_job_resumes_bitwise(slurm, tmp_path, demo_data):
    straight = submit(slurm, tmp_path / "straight", demo_data, epochs=4)
    wait_for(slurm, straight, DONE)
    job = submit(slurm, tmp_path / "preempted", demo_data, epochs=4)
    run_dir = tmp_path / "preempted" / "quickstart" / f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-*/COMPLETE.json")) and time.monotonic() < deadline:
        time.sleep(0.2)  # preempt after the first epoch: mid-run, with a checkpoint behind it
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    fields = wait_for(slurm, job, {"PENDING", "REQUEUED", "REQUEUE_HOLD"} | DONE, timeout_s=120)
    exited = time.monotonic() - signalled
    assert fields["JobState"] not in DONE, (run_dir / "slurm.log").read_text()[-3000:]
    assert int(fields["Restarts"]) == 1
    # The requeued job starts again by itself once its old credential expires (cred_expire, 10 s here).
    fields = wait_for(slurm, job, DONE)
    log = (run_dir / "slurm.log").read_text()
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    preempted = re.search(r"preempted \(SIGUSR1\) at step (\d+), ([\d.]+) s after the signal; saved (\S+); job \d+ requeued", log)
    assert preempted, log[-3000:]
    step = int(preempted.group(1))
    assert f"resuming from {preempted.group(3).rstrip(';')} (step {step})" in log, "resumed where it stopped: no step lost"
    first = re.search(r"first step after resuming \(step (\d+)\) done ([\d.]+) s after the process started", log)
    assert first and int(first.group(1)) == step + 1
    print(f"\nSIGUSR1 -> all ranks exited and job requeued: {exited:.1f} s; saved at step {step} "
          f"({preempted.group(2)} s after the signal); first resumed step {first.group(2)} s after the restart")
    a = torch.load(tmp_path / "straight" / "quickstart" / f"slurm-{straight}" / "model.pt", weights_only=True)
    b = torch.load(run_dir / "model.pt", weights_only=True)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted job"


def _task_pid(job: str, rank: int) -> int | None:
    for proc in psutil.process_iter(["cmdline", "environ"]):
        environ, cmdline = proc.info["environ"] or {}, " ".join(proc.info["cmdline"] or [])
        if (environ.get("SLURM_JOB_ID") == job and environ.get("SLURM_PROCID") == str(rank)
                and "lit-dist" in cmdline and "fit" in cmdline):
            return proc.pid
    return None


def test_a_rank_killed_outright_ends_the_job_without_a_hang(slurm, tmp_path, demo_data):
    job = submit(slurm, tmp_path, demo_data, epochs=50)
    run_dir = tmp_path / "quickstart" / f"slurm-{job}"
    deadline = time.monotonic() + 180
    while not list((run_dir / "checkpoints").glob("step-*/COMPLETE.json")) and time.monotonic() < deadline:
        time.sleep(0.2)  # training is under way on both ranks
    pid = _task_pid(job, rank=1)
    assert pid, f"no task of rank 1 found for job {job}"
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    fields = wait_for(slurm, job, DONE, timeout_s=120)
    took = time.monotonic() - killed
    log = (run_dir / "slurm.log").read_text()
    assert fields["JobState"] == "FAILED", fields
    assert re.search(r"task 1: Killed", log), log[-2000:]
    # The behaviour under test: the job ends, not hangs, once a rank is gone; 60 s is room for a loaded machine.
    assert took < 60, f"the job took {took:.0f} s to end after a rank was killed"
