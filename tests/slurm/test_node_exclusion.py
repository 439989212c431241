"""A faulty node stays out: a one-node job whose GPU (the NVML test double) faults is requeued with that node
added to the job's excluded nodes (the user's own exclusion kept), starts again on another node and resumes
from its checkpoint, on the emulated three-node cluster."""

import json
import re
import time

from tests.slurm.conftest import job_fields, sbatch, wait_for
from tests.slurm.test_slurm import DONE, extra


def test_a_gpu_fault_requeues_the_job_without_its_node_and_it_resumes_on_another(slurm_nodes, tmp_path, demo_data):
    env, _ = slurm_nodes
    env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
    state = tmp_path / "nvml.json"
    fault = {"ecc_after_polls": 16, "ecc": 2}  # 8 s into the fit: after its first checkpoints
    state.write_text(json.dumps({"node1": fault, "node2": fault}))  # wherever the job starts (node3: excluded)
    flags = (f"{extra(demo_data, epochs=30)} --checkpoint.every_n_steps 5 "
             "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker "
             "--trainer.callbacks.poll_interval_s 0.5 --trainer.callbacks.nvml_module tests.helpers.fake_nvml "
             "--trainer.callbacks.device_index 0")
    job = sbatch(env, "--exclude=node3", f"--export=ALL,ROOT={tmp_path},NAME=quickstart,EXTRA={flags},"
                 f"FAKE_NVML_STATE={state}", f"--output={tmp_path}/slurm-%j.out", "slurm/cpu.sbatch")
    log_path = tmp_path / "quickstart" / f"slurm-{job}" / "slurm.log"
    deadline = time.monotonic() + 240
    while not (log_path.exists() and "requeued without node" in log_path.read_text()):
        assert time.monotonic() < deadline, log_path.read_text()[-3000:] if log_path.exists() else "no log"
        assert job_fields(env, job).get("JobState") not in DONE, log_path.read_text()[-3000:]
        time.sleep(0.2)
    first = re.search(r"job \d+ on (node\d), restart 0", log_path.read_text()).group(1)
    state.write_text(json.dumps({first: fault}))  # the GPU stays faulty; the other nodes are healthy
    fields = wait_for(env, job, DONE, timeout_s=300)
    log = log_path.read_text()
    assert fields["JobState"] == "COMPLETED", log[-3000:]
    assert f"GPU fault on this rank's GPU 0: 2 new volatile uncorrectable ECC errors (node {first})" in log, log[-3000:]
    assert f"job {job} requeued without node {first}" in log, log[-3000:]
    second = re.search(r"job \d+ on (node\d), restart 1", log)
    assert second and second.group(1) not in (first, "node3"), log[-3000:]
    assert re.search(r"resuming from \S+step-\d+ \(step [1-9]\d*\)", log), "resumed from its checkpoint, not step 0"
    excluded = job_fields(env, job)["ExcNodeList"]
    assert excluded in (f"{first},node3", f"node[{first[-1]},3]"), excluded
