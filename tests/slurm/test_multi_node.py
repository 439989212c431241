"""Two emulated nodes (network namespaces, each with its own host name and address): DDP across
them under ``srun -N2``, and under ``torchrun --nnodes=2`` without Slurm."""

import json
import subprocess

from tests.conftest import REPO, quickstart_args
from tests.slurm import cluster

COMMON = ["--data.batch_size_per_device", "8", "--data.num_workers", "0",
          "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
          "--trainer.callbacks+=tests.helpers.recorder.WeightsDigest"]


def digests(run_dir) -> list[dict]:
    return [json.loads((run_dir / f"weights-rank{r}.json").read_text()) for r in range(2)]


def test_srun_on_two_nodes_trains_with_both_and_ends_with_the_same_weights(slurm_nodes, tmp_path, demo_data):
    env, _ = slurm_nodes
    out = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", env["LIT_DIST"], "fit",
                          *quickstart_args(tmp_path, demo_data, run__run_id="two-nodes"), *COMMON],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "trainer.num_nodes 2 (Slurm nodes)" in out.stdout
    ranks = digests(tmp_path / "quickstart" / "two-nodes")
    assert {r["host"] for r in ranks} == {"node1", "node2"} and {r["node_rank"] for r in ranks} == {0, 1}
    assert ranks[0]["sha256"] == ranks[1]["sha256"], "the two nodes ended with different weights"


def test_torchrun_across_two_nodes_without_slurm(slurm_nodes, tmp_path, demo_data):
    env, folder = slurm_nodes
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    procs = []
    for node in (1, 2):
        # A fixed rendezvous port is safe here: node1 is a network namespace of its own, where nothing else runs now.
        command = (f"exec {REPO}/.venv/bin/torchrun --nnodes=2 --nproc-per-node=1 --node-rank={node - 1} "
                   f"--master-addr=node1 --master-port=29517 --rdzv-id=job7 -m lit_dist fit "
                   f"{' '.join(quickstart_args(tmp_path, demo_data) + COMMON)}")
        procs.append(subprocess.Popen(cluster.node_command(folder, node, command), cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    ranks = digests(tmp_path / "quickstart" / "torchrun-job7")
    assert {r["host"] for r in ranks} == {"node1", "node2"}
    assert ranks[0]["sha256"] == ranks[1]["sha256"]


def test_scale_measures_one_and_two_nodes_with_one_srun_step_each(slurm_nodes, tmp_path, demo_data):
    env, _ = slurm_nodes
    out = subprocess.run([env["LIT_DIST"], "scale", *quickstart_args(tmp_path, demo_data), "--data.batch_size_per_device",
                          "8", "--data.num_workers", "0", "--nodes", "1,2", "--steps", "24"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    sizes = json.loads((tmp_path / "scale" / "scaling.json").read_text())
    assert [(s["nodes"], s["devices"]) for s in sizes] == [(1, 1), (2, 2)]
    assert all(s["samples_per_s"] > 0 for s in sizes) and sizes[0]["efficiency"] == 1.0
    assert "num_nodes: 2" in (tmp_path / "scale" / "nodes-2" / "config.yaml").read_text()
    assert "lit-dist scale: 2 devices (2 nodes x 1)" in out.stdout
