"""Goodput across requeues: the ledger in the checkpoint, the per-attempt journals, what restarts cost."""

import contextlib
import errno
import re
import signal

import pytest
import torch

from lit_dist.ckpt.store import CheckpointStore
from lit_dist.errors import ExitCode
from lit_dist.watch import goodput
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.small_fs import tmpfs


def test_a_journal_keeps_the_last_step_in_one_fixed_record_and_the_saves_and_end_in_json(tmp_path):
    journal = goodput.Journal(str(tmp_path), 2, started=100.0, resumed_step=5)
    for step in range(6, 40):
        journal.step(step, 100.0 + step)
    journal.saved(30, 131.5)
    assert (tmp_path / "attempt-002.step").stat().st_size == 64  # rewritten in place, never appended
    (info,) = goodput.attempts(str(tmp_path))
    assert (info["last_step"], info["last_time"], info["saves"], info["ended"]) == (39, 139.0, [[30, 131.5]], None)
    journal.ended("finished", 40, 141.0)
    (info,) = goodput.attempts(str(tmp_path))
    assert (info["last_step"], info["ended"]) == (40, "finished")


def test_a_journal_on_a_disk_that_fills_stops_with_one_warning_and_keeps_what_it_wrote(tmp_path, caplog):
    # The checkpoint that just filled the disk is announced to the journal (rank 0 alone): raising there would
    # leave the other ranks waiting in the next collective; the next save says the disk is full, on every rank.
    with contextlib.ExitStack() as stack:
        small = stack.enter_context(tmpfs(tmp_path / "small", 64))
        journal = goodput.Journal(str(small), 1, started=100.0, resumed_step=None)
        journal.step(3, 103.0)
        with pytest.raises(OSError) as filling:
            (small / "filler").write_bytes(b"x" * 128 * 1024)
        assert filling.value.errno == errno.ENOSPC
        journal.saved(4, 104.0)
        journal.saved(6, 106.0)
        journal.step(7, 107.0)
        warnings = [r.getMessage() for r in caplog.records if "goodput journal" in r.getMessage()]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
        (info,) = goodput.attempts(str(small))
        assert info["saves"] == []  # as last written before the disk filled
        assert (info["last_step"], info["last_time"]) == (7, 107.0)  # the step record is rewritten in place
        (small / "filler").unlink()  # room again (the failed save removed): the end is written, with the saves
        journal.ended("failed (exit 16, StorageFull)", 7, 107.5)
        (info,) = goodput.attempts(str(small))
        assert (info["saves"], info["ended"]) == ([[4, 104.0], [6, 106.0]], "failed (exit 16, StorageFull)")


def test_losses_count_what_each_attempt_did_after_the_checkpoint_the_run_resumed_from():
    previous = [
        # saved at steps 5 and 10, killed after step 12; the checkpoint of step 10 carries its ledger
        {"attempt": 1, "started": 0.0, "resumed_step": None, "saves": [[5, 50.0], [10, 100.0]], "ended": None,
         "last_step": 12, "last_time": 120.0},
        # resumed at 10, crashed after step 14 before its first save: all of it is lost
        {"attempt": 2, "started": 200.0, "resumed_step": 10, "saves": [], "ended": "failed (exit 1, RuntimeError)",
         "last_step": 14, "last_time": 260.0},
        # never reached a step
        {"attempt": 3, "started": 300.0, "resumed_step": 10, "saves": [], "ended": None,
         "last_step": None, "last_time": None},
    ]
    lost = goodput.losses(previous, resumed_step=10, saved_by=1, saved_at=100.0)
    assert [(x["attempt"], x["steps_redone"], x["lost_s"]) for x in lost] == [(1, 2, 20.0), (2, 4, 60.0), (3, 0, 0.0)]
    assert lost[0]["ended"] == "killed (no word)"
    # A start without a checkpoint: every earlier attempt was lost from its beginning.
    lost = goodput.losses(previous[:1], resumed_step=0, saved_by=None, saved_at=None)
    assert [(x["steps_redone"], x["lost_s"]) for x in lost] == [(12, 120.0)]
    # The attempt before the one that saved the checkpoint is in that checkpoint's ledger already.
    assert [x["attempt"] for x in goodput.losses(previous[:2], 12, saved_by=2, saved_at=250.0)] == [2]


def _fit(tmp_path, demo_data, *extra):
    args = quickstart_args(tmp_path, demo_data, data__num_workers=0, data__batch_size_per_device=8,
                           trainer__max_steps=30, run__run_id="r", checkpoint__every_n_steps=5,
                           checkpoint__every_n_epochs=None, trainer__enable_progress_bar=False)
    return lit_dist("fit", *args, *extra)


@pytest.mark.process
def test_a_run_killed_twice_and_preempted_once_reports_exactly_the_steps_it_redid(tmp_path, demo_data):
    kill = "--trainer.callbacks+=tests.helpers.recorder.KillAtStep"
    # 1: killed after step 8 -> resumes from 5, 3 steps redone.
    assert _fit(tmp_path, demo_data, kill, "--trainer.callbacks.step", "8").returncode == -signal.SIGKILL
    # 2: preempted at step 12: it saves there, nothing is redone.
    out = _fit(tmp_path, demo_data, "--trainer.callbacks+=tests.helpers.recorder.SignalRankAtStep",
               "--trainer.callbacks.step", "12", "--trainer.callbacks.rank", "0")
    assert out.returncode == ExitCode.PREEMPTED, out.stderr[-3000:]
    # 3: killed after step 17 -> resumes from 15, 2 steps redone.
    assert _fit(tmp_path, demo_data, kill, "--trainer.callbacks.step", "17").returncode == -signal.SIGKILL
    out = _fit(tmp_path, demo_data)
    assert out.returncode == 0, out.stderr[-3000:]

    run = tmp_path / "quickstart" / "r"
    store = CheckpointStore(str(run / "checkpoints"))
    state = torch.load(run / "checkpoints" / store.complete()[0] / "state.ckpt", weights_only=False)
    ledger = goodput.Ledger.from_dict(state["callbacks"]["Progress"]["goodput"])
    assert ledger.steps_redone == 5 and ledger.attempts == 4
    assert [(r["attempt"], r["steps_redone"]) for r in ledger.restarts] == [(1, 3), (2, 0), (3, 2)]
    assert [r["ended"] for r in ledger.restarts] == ["killed (no word)", "preempted", "killed (no word)"]
    assert ledger.seconds["lost"] > 0 and ledger.seconds["startup"] > 0 and 0 < ledger.goodput < 1
    assert sorted(p.name for p in (run / "goodput").glob("*.json")) == [f"attempt-00{i}.json" for i in (1, 2, 3, 4)]
    assert "lit-dist: restart 3: 5 steps redone so far, " in out.stdout, out.stdout[-2000:]
    line = re.search(r"lit-dist: goodput (\d+\.\d)% of \S+: .*lost \S+ \(3 restarts, 5 steps redone\)", out.stdout)
    assert line, out.stdout[-2000:]
