"""The hang watchdog on 2 processes: rank 1 blocks inside a step; both ranks exit 12 well before the collective
timeout, every rank's stacks are dumped (rank 1's shows the blocking frame), and run.hung names rank 1."""

import re
import time

import pytest

from lit_dist.errors import ExitCode
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.http_server import Recorder

pytestmark = [pytest.mark.distributed, pytest.mark.serial]  # step limits of a few seconds


def test_a_rank_blocked_in_a_step_is_named_and_every_rank_exits_12_with_its_stacks(tmp_path, demo_data):
    server = Recorder()
    started = time.monotonic()
    try:
        out = lit_dist(
            "fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, data__num_workers=0,
                                    trainer__devices=2, trainer__strategy="ddp", trainer__max_epochs=1000,
                                    trainer__enable_progress_bar=False, run__run_id="r"),
            "--watchdog.timeout_s", "8", "--watchdog.heartbeat_s", "2",
            "--trainer.callbacks+=tests.helpers.recorder.BlockRankAtStep", "--trainer.callbacks.step", "6",
            "--trainer.callbacks+=lit_dist.callbacks.webhooks.WebhookNotifier",
            "--trainer.callbacks.sinks", '[{"kind": "raw", "url_env": "HOOK_URL"}]',
            env={"HOOK_URL": server.url("/hook")}, timeout=240)
        elapsed = time.monotonic() - started
        hung = [e for e in server.bodies("/hook") if e["type"] == "run.hung"]
    finally:
        server.shutdown()
    assert out.returncode == ExitCode.HUNG, out.stderr[-3000:]
    # Start-up, 6 steps, then 8 s without a step + heartbeats + the others' grace: far below 30 minutes.
    assert elapsed < 120, elapsed
    assert "lit-dist: hang: no optimizer step for" in out.stderr and re.search(r"ranks behind: 1 \(\S+\);", out.stderr), out.stderr[-3000:]
    assert len(hung) == 1 and hung[0]["data"]["behind"] == [1] and hung[0]["severity"] == "critical", hung
    assert hung[0]["data"]["step"] == 6
    dumps = {rank: (tmp_path / "quickstart" / "r" / "hang" / f"rank-{rank}.txt").read_text() for rank in (0, 1)}
    assert "in on_train_batch_start" in dumps[1] and "time.sleep(self.seconds)" in dumps[1], dumps[1]
    assert "last finished step 6" in dumps[0] and "Thread MainThread" in dumps[0]
