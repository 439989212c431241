"""Checkpoint files, manifests, rotation, damaged checkpoints and asynchronous saves (one process)."""

import hashlib
import json
import os

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.ckpt import resume
from lit_dist.ckpt.files import filesystem, write_atomically
from lit_dist.ckpt.store import LATEST, MARKER, STATE, CheckpointStore, checkpoint_name, share_of
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import CheckpointError, ConfigError, DataError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import SimpleCNN
from lit_dist.runtime.control import RunControl
from tests.conftest import lit_dist, quickstart_args


def train(root, demo_data, max_steps=12, control=None, **checkpointing):
    control = control or {}
    seed_everything(0)
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.1)
    callback = Checkpointing(dirpath=str(root / "ckpt"), **{"every_n_epochs": None, **checkpointing})
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[RunControl(**control), callback], num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=root)
    trainer.fit(model, dm)
    return callback, CheckpointStore(str(root / "ckpt"))


def test_every_file_is_in_the_manifest_and_rotation_keeps_the_newest(tmp_path, demo_data):
    callback, store = train(tmp_path, demo_data, max_steps=12, every_n_steps=2, keep_last_n=2)
    assert store.names() == [checkpoint_name(12), checkpoint_name(10)]
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == checkpoint_name(12)
    assert callback.last_path == str(tmp_path / "ckpt" / checkpoint_name(12))
    for name in store.names():
        manifest = json.loads((tmp_path / "ckpt" / name / MARKER).read_text())
        data = (tmp_path / "ckpt" / name / STATE).read_bytes()
        assert manifest["files"] == {STATE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        assert manifest["step"] == int(name.split("-")[1]) and manifest["reason"] in ("steps", "end")
    leftovers = [p.name for p in (tmp_path / "ckpt").rglob("*") if p.name.startswith(".")]
    assert leftovers == [], "temporary files were left behind"


def test_keep_last_n_below_two_and_bad_values_are_named():
    with pytest.raises(ConfigError) as err:
        Checkpointing(keep_last_n=1, every_n_steps=0, mode="best")
    message = str(err.value)
    assert "keep_last_n: 1" in message and "every_n_steps: 0" in message and "checkpoint.mode" in message


def fake_checkpoints(store: CheckpointStore, steps_and_losses) -> None:
    for step, loss in steps_and_losses:
        name = checkpoint_name(step)
        store.begin(name)
        entry = write_atomically(store.fs, f"{store.staging(name)}/{STATE}", lambda f, s=step: f.write(bytes([s]) * 100))
        store.finish(name, {STATE: entry}, {"step": step, "metric": {"name": "val/loss", "value": loss}})


def test_rotation_keeps_newest_best_and_the_resume_source(tmp_path):
    store = CheckpointStore(str(tmp_path))
    fake_checkpoints(store, [(10, 0.9), (20, 0.2), (30, 0.5), (40, 0.7), (50, 0.8)])
    deleted = store.rotate(keep_last_n=2, protect={checkpoint_name(10)}, monitor="val/loss", keep_best_k=1)
    assert sorted(deleted) == [checkpoint_name(30)]
    assert store.names() == [checkpoint_name(s) for s in (50, 40, 20, 10)]
    assert store.best("val/loss") == checkpoint_name(20)
    assert store.best("val/loss", mode="max") == checkpoint_name(10)


def damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "marker":
        (path.parent / MARKER).write_text("{not json")
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("how", ["truncate", "flip", "marker", "missing"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, how, recwarn):
    store = CheckpointStore(str(tmp_path))
    fake_checkpoints(store, [(10, None), (20, None)])
    damage(tmp_path / checkpoint_name(20) / STATE, how)
    callback = Checkpointing(dirpath=str(tmp_path))
    callback._store = store
    assert callback.resolve_ckpt_path(None, "auto") == str(tmp_path / checkpoint_name(10) / STATE)
    assert callback.resumed_from == checkpoint_name(10)
    warning = " ".join(str(w.message) for w in recwarn)
    assert checkpoint_name(20) in warning and f"falling back to {checkpoint_name(10)}" in warning


def test_no_usable_checkpoint_is_an_error_and_an_explicit_damaged_one_too(tmp_path):
    store = CheckpointStore(str(tmp_path))
    fake_checkpoints(store, [(10, None), (20, None)])
    damage(tmp_path / checkpoint_name(20) / STATE, "flip")
    callback = Checkpointing(dirpath=str(tmp_path))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        callback.resolve_ckpt_path(None, str(tmp_path / checkpoint_name(20)))
    damage(tmp_path / checkpoint_name(10) / STATE, "truncate")
    callback._store = store
    with pytest.raises(CheckpointError, match="none is usable"):
        callback.resolve_ckpt_path(None, "auto")


def test_the_ranks_split_the_files_to_verify_once_between_them():
    sizes = {f"shard-{i}": size for i, size in enumerate([900, 800, 500, 400, 400, 300, 100, 10, 0])}
    for world in (1, 2, 3, 8, 16):
        shares = [share_of(sizes, rank, world) for rank in range(world)]
        flat = [rel for share in shares for rel in share]
        assert sorted(flat) == sorted(sizes), f"world {world}: every file once, by exactly one rank"
        loads = [sum(sizes[rel] for rel in share) for share in shares]
        assert max(loads) - min(loads) <= max(sizes.values()), f"world {world}: {loads}"
    assert share_of(sizes, 0, 2) == ["shard-0", "shard-3", "shard-4", "shard-7"]  # 1,710 bytes, rank 1 1,700


def test_a_rank_reads_only_its_share_and_a_marked_checkpoint_is_passed_over(tmp_path, recwarn):
    store = CheckpointStore(str(tmp_path))
    fake_checkpoints(store, [(10, None), (20, None)])
    name = checkpoint_name(20)
    damage(tmp_path / name / STATE, "flip")
    owner = next(rank for rank in range(3) if share_of({STATE: 100}, rank, 3))
    for rank in range(3):  # one file: one rank reads it, the others find nothing and choose the same checkpoint
        choice = resume.newest_usable(store, share=(rank, 3))
        assert choice.name == name
        assert (choice.share_problem is not None) == (rank == owner), rank
    assert "does not match its sha256" in resume.newest_usable(store, share=(owner, 3)).share_problem

    store.mark_damaged(name, "rank 0 on node7 found state.ckpt does not match its sha256 (corrupted)")
    assert store.problem(name) == "marked damaged: rank 0 on node7 found state.ckpt does not match its sha256 (corrupted)"
    assert resume.newest_usable(store, share=(1, 3)).name == checkpoint_name(10), "no rank picks it again"
    callback = Checkpointing(dirpath=str(tmp_path))
    callback._store = store
    assert callback.resolve_ckpt_path(None, "auto") == str(tmp_path / checkpoint_name(10) / STATE)
    assert f"{name} is unusable: marked damaged: rank 0 on node7" in " ".join(str(w.message) for w in recwarn)


def test_a_first_save_cut_off_before_its_marker_means_starting_over(tmp_path):
    # What an object store keeps of an upload killed mid-way: the folder at its final name, no marker.
    (tmp_path / checkpoint_name(5)).mkdir()
    (tmp_path / checkpoint_name(5) / STATE).write_bytes(b"half an upload")
    callback = Checkpointing(dirpath=str(tmp_path))
    callback._store = CheckpointStore(str(tmp_path))
    assert callback.resolve_ckpt_path(None, "auto") is None
    fake_checkpoints(callback._store, [(3, None)])  # an older complete one that is damaged: progress at stake
    damage(tmp_path / checkpoint_name(3) / STATE, "flip")
    with pytest.raises(CheckpointError, match="1 complete checkpoints .* none is usable"):
        callback.resolve_ckpt_path(None, "auto")


def test_export_and_resume_choose_the_same_checkpoint_past_unfinished_saves(tmp_path):
    from lit_dist.ckpt.export import lit_dist_checkpoint

    callback = Checkpointing(dirpath=str(tmp_path))
    callback._store = CheckpointStore(str(tmp_path))
    (tmp_path / checkpoint_name(9)).mkdir()  # the newest: an upload cut off before its marker
    (tmp_path / checkpoint_name(9) / STATE).write_bytes(b"half an upload")
    with pytest.raises(DataError, match="only unfinished saves"):
        lit_dist_checkpoint(str(tmp_path))
    assert callback.resolve_ckpt_path(None, "auto") is None, "nothing lost: the run starts over"
    fake_checkpoints(callback._store, [(4, None)])
    chosen = callback.resolve_ckpt_path(None, "auto")
    assert chosen == lit_dist_checkpoint(str(tmp_path)) == str(tmp_path / checkpoint_name(4) / STATE)
    damage(tmp_path / checkpoint_name(4) / STATE, "flip")  # now progress is at stake: both refuse
    with pytest.raises(CheckpointError, match="1 complete checkpoints .* none is usable"):
        callback.resolve_ckpt_path(None, "auto")
    with pytest.raises(DataError, match="1 complete checkpoints .* none is usable"):
        lit_dist_checkpoint(str(tmp_path))


def test_an_interrupted_write_leaves_nothing_at_the_final_path(tmp_path):
    fs, path = filesystem(str(tmp_path / "state.ckpt"))
    write_atomically(fs, path, lambda f: f.write(b"old complete file"))

    def dies_halfway(f):
        f.write(b"x" * (2 << 20))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(fs, path, dies_halfway)
    assert (tmp_path / "state.ckpt").read_bytes() == b"old complete file"
    assert os.listdir(tmp_path) == ["state.ckpt"]


def _write_large_file(path: str) -> None:
    fs, path = filesystem(path)
    data = os.urandom(4 << 20)  # large enough to be hashed on the helper thread
    assert write_atomically(fs, path, lambda f: f.write(data)).sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.process
def test_a_forked_child_writes_large_files_after_its_parent_did(tmp_path):
    """The parent's hashing thread does not survive a fork; the child gets a pool of its own, not a hang."""
    import multiprocessing

    _write_large_file(str(tmp_path / "parent.bin"))  # the parent's hashing thread is running now
    child = multiprocessing.get_context("fork").Process(target=_write_large_file, args=(str(tmp_path / "child.bin"),))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the forked child never finished its write"
    assert (tmp_path / "child.bin").stat().st_size == 4 << 20


def test_asynchronous_saves_write_the_same_checkpoints(tmp_path, demo_data):
    _, sync = train(tmp_path / "sync", demo_data, max_steps=9, every_n_steps=3)
    _, background = train(tmp_path / "async", demo_data, max_steps=9, every_n_steps=3, async_save=True)
    assert sync.names() == background.names() == [checkpoint_name(s) for s in (9, 6, 3)]
    for name in sync.names():
        assert background.problem(name) is None
        a = torch.load(f"{sync.path(name)}/{STATE}", weights_only=True)
        b = torch.load(f"{background.path(name)}/{STATE}", weights_only=True)
        for key in ("state_dict",):
            for k in a[key]:
                assert torch.equal(a[key][k], b[key][k]), f"{name}: {k} differs"
        assert a["optimizer_states"][0]["state"][0]["exp_avg"].equal(b["optimizer_states"][0]["state"][0]["exp_avg"])
        assert a["global_step"] == b["global_step"]


def test_monitor_records_the_metric_and_keeps_the_best(tmp_path, demo_data):
    seed_everything(0)
    model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0, val_fraction=0.2)
    callback = Checkpointing(dirpath=str(tmp_path / "ckpt"), every_n_epochs=None, monitor="val/loss",
                             keep_last_n=2, keep_best_k=1)
    trainer = Trainer(max_steps=24, val_check_interval=4, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback], num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(model, dm)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    values = {n: store.manifest(n)["metric"]["value"] for n in store.names()}
    best = min(values, key=values.get)
    assert len(values) in (2, 3) and checkpoint_name(24) in values
    assert callback.best_model_path == f"{tmp_path / 'ckpt' / best}/{STATE}"


@pytest.mark.process
def test_the_cli_resumes_by_default_and_says_where_it_fell_back(tmp_path, demo_data):
    args = ["fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, run__run_id="r1",
                                    trainer__enable_progress_bar=False)]
    first = lit_dist(*args, "--trainer.max_epochs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    folder = tmp_path / "quickstart" / "r1" / "checkpoints"
    names = sorted(p.name for p in folder.glob("step-*"))
    assert len(names) == 2, names
    damage(folder / names[-1] / STATE, "flip")
    second = lit_dist(*args, "--trainer.max_epochs", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    output = second.stdout + second.stderr
    assert f"{names[-1]} is unusable" in output and f"falling back to {names[0]}" in output
    assert f"resuming from {folder / names[0]}" in output
    assert "weights_only" not in output, "lit-dist's own checkpoints load without pickled objects"


def test_every_n_minutes_saves_when_the_time_has_come_at_agreed_steps(tmp_path, demo_data):
    # 0.001 minutes (60 ms) pass between two saves some steps apart; on one process the run control
    # agrees at every step, so each save is due a few steps after the one before.
    _, store = train(tmp_path, demo_data, max_steps=12, every_n_minutes=0.0001, save_last=False, keep_last_n=20)
    assert store.names() == [checkpoint_name(s) for s in range(12, 0, -1)]
    assert {store.manifest(n)["reason"] for n in store.names()} == {"time"}


def test_a_checkpoint_folder_that_cannot_be_written_is_a_config_error_before_training(tmp_path, demo_data):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ConfigError, match="checkpoint.dirpath: cannot write to .*a-file/ckpt"):
        seed_everything(0)
        model = LitModel(SimpleCNN(num_classes=4), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0)
        trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
                          callbacks=[Checkpointing(dirpath=str(tmp_path / "a-file" / "ckpt"))])
        trainer.fit(model, dm)
