"""lit-dist started by other launchers than Lightning's own: torchrun and the DeepSpeed launcher on one
machine (2 CPU processes). Each process finds the layout in its environment; nothing else is set."""

import glob
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, REPO, quickstart_args
from tests.helpers.ports import free_port

pytestmark = pytest.mark.distributed
BIN = Path(sys.executable).parent
COMMON = ["--data.batch_size_per_device", "8",
          "--data.num_workers", "0", "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
          "--trainer.strategy", "ddp", "--export.filename", "null"]


def check(out: subprocess.CompletedProcess, launcher: str) -> None:
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    assert f"trainer.devices 2 ({launcher} processes per node)" in output
    assert "effective batch 16 = 8 per device x 2 devices" in output and "fit finished" in output


def test_torchrun_on_one_machine(tmp_path, demo_data):
    out = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node=2", f"--master-port={free_port()}", "-m", "lit_dist", "fit",
                          *quickstart_args(tmp_path, demo_data), *COMMON],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    check(out, "torchrun")


@pytest.mark.skipif(not shutil.which("deepspeed", path=str(BIN)), reason="DeepSpeed is not installed")
def test_the_deepspeed_launcher_on_one_machine(tmp_path, demo_data):
    # It adds --local_rank=N to the command line, which lit-dist takes from LOCAL_RANK instead.
    # And trains with DeepSpeed itself (ZeRO-2 on the CPU processes), not DDP.
    zero2 = [a for a in COMMON if a not in ("--trainer.strategy", "ddp")]
    port = free_port()
    out = subprocess.run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "--module", "lit_dist",
                          "fit", *quickstart_args(tmp_path, demo_data, CONFIGS / "deepspeed_zero2.yaml", run__run_id="ds",
                                                  trainer__accelerator="cpu"), *zero2],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    check(out, "DeepSpeed launcher")
    newest = sorted((tmp_path / "quickstart" / "ds" / "checkpoints").glob("step-*"))[-1]
    assert (newest / "state.ckpt").is_dir(), "a DeepSpeed checkpoint folder: DeepSpeed trained"
    # Under its own launcher DeepSpeed all-reduces on CPU through a 69 MB shared-memory buffer per rank, which it
    # never removes: lit-dist removes their names once every rank has mapped them.
    assert glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*") == []


@pytest.mark.parametrize("warm", [True, False])
def test_lightnings_own_launcher_starts_the_local_ranks_from_a_warm_fork(tmp_path, demo_data, warm):
    # trainer.devices 2 on one machine: rank 1 forked by rank 0's zygote after the imports, or (turned off) a new
    # interpreter Lightning starts. Either way rank 1 is rank 0's child and knows its own rank.
    import json

    from tests.conftest import lit_dist

    # A loader worker each: rank 0's fork server, forked after the zygote, holds a copy of the zygote's socket.
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data), *COMMON, "--trainer.devices", "2",
                   "--trainer.max_steps", "2", "--run.run_id", "r", "--data.num_workers", "1",
                   "--trainer.callbacks+=tests.helpers.recorder.WhoAmI",
                   env={"LIT_DIST_WARM_RANKS": "1" if warm else "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    who = [json.loads((tmp_path / "quickstart" / "r" / f"who-rank{r}.json").read_text()) for r in range(2)]
    assert who[1]["ppid"] == who[0]["pid"] and [w["rank_zero_only"] for w in who] == [0, 1], who
    # A fork keeps rank 0's command line; Lightning's launcher runs `python -m lit_dist.__main__ ...`.
    assert (who[1]["cmdline"] == who[0]["cmdline"]) == warm, who
