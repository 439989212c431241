"""Checkpoints on an object store that goes away, made the way it happens: the real local S3 server behind a TCP
proxy that the test cuts (connections reset, new ones refused) and restores. The training data is on local disk:
only the checkpoints cross the proxy. A short outage during a save or a resume costs only its length (the same
checkpoint, complete); one past ``checkpoint.outage_deadline_s`` stops every rank with exit 17 and one line naming
what it was doing, leaves no checkpoint that passes for complete, and no process."""

import hashlib
import json
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

from lit_dist.ckpt.files import FileEntry, filesystem, write_atomically
from lit_dist.ckpt.io import AtomicCheckpointIO
from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore, checkpoint_name
from lit_dist.errors import ExitCode
from lit_dist.runtime.outage import FIRST_WAIT_S, StoreUnreachable
from tests.conftest import CONFIGS, start_module
from tests.helpers.processes import Output, finish, left_after
from tests.helpers.tcp_proxy import TcpProxy
from tests.s3.outages import QUICK, SECOND_WAIT

# Mostly waiting on outages and deadlines (7 minutes of a test worker): beside the parallel tests, in .ci/test's second
# process, whose slurm tests mostly wait too.
pytestmark = [pytest.mark.s3, pytest.mark.beside]
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "PYTHONFAULTHANDLER": "1"}


@pytest.fixture
def proxied(s3):
    endpoint = urlparse(s3.endpoint)
    proxy = TcpProxy((endpoint.hostname, endpoint.port))
    yield f"s3://{s3.bucket}/ckpt", proxy
    proxy.close()


def direct(s3, url: str) -> CheckpointStore:
    """The store as the server has it (not through the proxy)."""
    return CheckpointStore(url, {"client_kwargs": {"endpoint_url": s3.endpoint}, "skip_instance_cache": True})


def start(tmp_path, demo_data, url, proxy, run_id, *extra):
    """A quickstart fit on local data, its checkpoints (every 10 steps) through the proxy, in a session of its own."""
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
            "--data.batch_size_per_device", "8", "--trainer.max_steps", "20", "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--run.root_dir", str(tmp_path), "--run.run_id", run_id,
            "--export.filename", "null", "--checkpoint.dirpath", f"{url}/{{run_id}}", "--checkpoint.every_n_steps", "10",
            "--checkpoint.storage_options", json.dumps({"client_kwargs": {"endpoint_url": proxy.url}, **QUICK}), *extra]
    return start_module("lit_dist", *args, env=ENV)


def before_the_save_at_step_10(tmp_path):
    """Callbacks that mark step 9's end, then hold rank 0 for 2 s: the test cuts the store before step 10's save."""
    marker = tmp_path / "cut-now"
    return marker, ("--trainer.callbacks+=tests.helpers.recorder.MarkAtStep", "--trainer.callbacks.step", "9",
                    "--trainer.callbacks.path", str(marker),
                    "--trainer.callbacks+=tests.helpers.recorder.BlockRankAtStep", "--trainer.callbacks.step", "9",
                    "--trainer.callbacks.rank", "0", "--trainer.callbacks.seconds", "2")


def wait_for(marker, proc):
    deadline = time.monotonic() + 180
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the run never reached step 9:\n{proc.communicate()[1][-3000:]}"


FSDP2 = ["--config", str(CONFIGS / "fsdp2.yaml"), "--trainer.devices", "2"]  # every rank uploads its shard file


@pytest.mark.slow
@pytest.mark.parametrize("strategy,async_save", [("single", False), ("single", True), ("fsdp2", True)],
                         ids=["sync", "async", "fsdp2-async"])
def test_a_short_outage_during_a_save_costs_its_length_and_the_checkpoints_are_complete(tmp_path, demo_data, proxied, s3,
                                                                                        strategy, async_save):
    url, proxy = proxied
    marker, callbacks = before_the_save_at_step_10(tmp_path)
    sharded = FSDP2 if strategy == "fsdp2" else []
    proc = start(tmp_path, demo_data, url, proxy, "run", "--checkpoint.async_save", str(async_save).lower(), *sharded,
                 *callbacks)
    wait_for(marker, proc)
    proxy.cut()
    output = Output(proc)
    assert output.wait_for(SECOND_WAIT), output.tail()  # the save has waited twice (1 s, 2 s): the store comes back
    proxy.restore()
    code, out, err = output.finish()
    assert code == 0, err[-3000:]
    assert "the object store does not answer" in err and f"saving step 10 to {url}/run/step-000000010" in err, err[-3000:]
    store = direct(s3, f"{url}/run")
    assert store.complete() == [checkpoint_name(20), checkpoint_name(10)]
    for name in store.complete():
        assert store.problem(name) is None, name  # every file there, with the size and sha256 of its manifest
    assert store.manifest(checkpoint_name(10))["step"] == 10

    again = start(tmp_path, demo_data, url, proxy, "run", "--trainer.max_steps", "25", *sharded)
    code, out, err = finish(again)
    assert code == 0, err[-3000:]
    assert f"resuming from {url}/run/{checkpoint_name(20)} (step 20)" in out + err
    assert store.complete()[0] == checkpoint_name(25)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,async_save", [("ddp", False), ("ddp", True), ("fsdp2", True)],
                         ids=["sync", "async", "fsdp2-async"])
def test_an_outage_past_its_deadline_during_a_save_stops_every_rank_with_exit_17(tmp_path, demo_data, proxied, s3,
                                                                                 strategy, async_save):
    url, proxy = proxied
    marker, callbacks = before_the_save_at_step_10(tmp_path)
    sharded = FSDP2 if strategy == "fsdp2" else ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    proc = start(tmp_path, demo_data, url, proxy, "gone", "--checkpoint.outage_deadline_s", "5",
                 "--checkpoint.async_save", str(async_save).lower(), *sharded, "--trainer.max_steps", "1000",
                 *callbacks)
    wait_for(marker, proc)
    proxy.cut()
    started = time.monotonic()
    code, _, err = finish(proc)
    elapsed = time.monotonic() - started
    left = left_after(proc.pid, 10)
    assert code == ExitCode.STORE_UNREACHABLE, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("lit-dist: error:")]
    assert lines and all("rank 0: the object store did not answer for" in line for line in lines), err[-3000:]
    assert f"saving step 10 to {url}/gone/step-000000010" in lines[0], lines
    assert "retry the job later (checkpoint.outage_deadline_s: 5 s)" in lines[0], lines
    assert "Traceback" not in err, err[-3000:]
    # From the cut: rank 0's 2 s hold before step 10's save, the deadline counted from the first failed request (one
    # attempt, refused at once), one last request (at most QUICK's connect and read timeouts, 7 s), the end of both
    # ranks (about 4 s; 30 s allowed on a busy machine).
    assert elapsed < 2 + 5 + 7 + 30, elapsed
    assert not left, left
    proxy.restore()
    store = direct(s3, f"{url}/gone")
    assert checkpoint_name(10) not in store.complete(), "a save cut off by the outage passes for complete"
    assert store.find_valid()[0] is None


@pytest.mark.slow
def test_a_short_outage_while_resuming_costs_its_length(tmp_path, demo_data, proxied, s3):
    url, proxy = proxied
    code, _, err = finish(start(tmp_path, demo_data, url, proxy, "run"))
    assert code == 0, err[-3000:]
    proxy.cut()
    again = start(tmp_path, demo_data, url, proxy, "run", "--trainer.max_steps", "25")
    output = Output(again)
    assert output.wait_for(SECOND_WAIT), output.tail()  # the resume has waited twice (1 s, 2 s): the store comes back
    proxy.restore()
    code, out, err = output.finish()
    assert code == 0, err[-3000:]
    assert "the object store does not answer" in err and f"listing the checkpoints in {url}/run" in err, err[-3000:]
    assert f"resuming from {url}/run/{checkpoint_name(20)} (step 20)" in out + err
    store = direct(s3, f"{url}/run")
    assert store.complete() == [checkpoint_name(25), checkpoint_name(20), checkpoint_name(10)]


@pytest.mark.slow
def test_an_outage_past_its_deadline_while_resuming_is_exit_17_not_a_fresh_start(tmp_path, demo_data, proxied, s3):
    url, proxy = proxied
    code, _, err = finish(start(tmp_path, demo_data, url, proxy, "run"))
    assert code == 0, err[-3000:]
    proxy.cut()
    folder = f"{url}/run/{checkpoint_name(20)}"
    for ckpt_path, doing in (("auto", f"listing the checkpoints in {url}/run"), (folder, f"reading checkpoint {folder}")):
        proc = start(tmp_path, demo_data, url, proxy, "run", "--trainer.max_steps", "25", "--ckpt_path", ckpt_path,
                     "--checkpoint.outage_deadline_s", "4")
        code, out, err = finish(proc)
        assert not left_after(proc.pid, 10)
        assert code == ExitCode.STORE_UNREACHABLE, err[-3000:]
        assert "lit-dist: error: the object store did not answer for" in err and doing in err, err[-3000:]
        assert "Traceback" not in err and "starting from the beginning" not in out + err, err[-3000:]
    proxy.restore()
    assert direct(s3, f"{url}/run").complete() == [checkpoint_name(20), checkpoint_name(10)]


@pytest.mark.slow
def test_an_outage_past_its_deadline_when_the_checkpoint_folder_is_made_stops_every_rank(tmp_path, demo_data, proxied):
    url, proxy = proxied
    proxy.cut()
    proc = start(tmp_path, demo_data, url, proxy, "fresh", "--ckpt_path", "null", "--checkpoint.outage_deadline_s", "4",
                 "--trainer.devices", "2", "--trainer.strategy", "ddp")
    code, _, err = finish(proc)
    left = left_after(proc.pid, 10)
    assert code == ExitCode.STORE_UNREACHABLE, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("lit-dist: error:")]
    assert len(lines) == 2, err[-3000:]  # rank 0's, and rank 1's, told by rank 0 instead of waiting for it
    assert all("rank 0: the object store did not answer for" in line and f"making the checkpoint folder {url}/fresh"
               in line for line in lines), lines
    assert "Traceback" not in err and not left, (err[-3000:], left)


def outage_for(proxy, seconds: float) -> threading.Timer:
    """Cut the store now, restore it ``seconds`` from now."""
    proxy.cut()
    timer = threading.Timer(seconds, proxy.restore)
    timer.start()
    return timer


@pytest.mark.slow
def test_every_request_of_the_checkpoint_code_waits_out_a_short_outage(s3, proxied):
    """Each request is cut on its own: the upload, the markers, listing, reading, hashing, loading, deleting."""
    url, proxy = proxied
    options = {"client_kwargs": {"endpoint_url": proxy.url}, **QUICK}
    store, io = CheckpointStore(url, options, outage_deadline_s=60), AtomicCheckpointIO(options, outage_deadline_s=60)
    state = {"global_step": 1, "weights": torch.arange(1000.0)}
    waited = {}

    def through_an_outage(what, operation):
        timer = outage_for(proxy, 0.5)  # the first attempt fails, the one lit-dist makes 1 s later does not
        began = time.monotonic()
        result = operation()
        waited[what] = time.monotonic() - began
        timer.join()
        return result

    for step in (1, 2, 3):
        name = checkpoint_name(step)
        through_an_outage("begin", lambda name=name: store.begin(name))
        through_an_outage("upload", lambda name=name: io.save_checkpoint(state, store.url_of(name, STATE)))
        entry = io.written.pop(store.url_of(name, STATE))
        through_an_outage("marker", lambda name=name, entry=entry, step=step: store.finish(name, {STATE: entry}, {"step": step}))
    through_an_outage("metric", lambda: store.set_metric(checkpoint_name(3), {"name": "val/loss", "value": 0.5}))
    store._manifests.clear()
    assert through_an_outage("listing", store.complete) == [checkpoint_name(3), checkpoint_name(2), checkpoint_name(1)]
    assert through_an_outage("reading", lambda: store.problem(checkpoint_name(3))) is None
    loaded = through_an_outage("loading", lambda: io.load_checkpoint(store.url_of(checkpoint_name(3), STATE)))
    assert torch.equal(loaded["weights"], state["weights"])
    assert through_an_outage("rotation", lambda: store.rotate(2, set())) == [checkpoint_name(1)]
    assert direct(s3, url).complete() == [checkpoint_name(3), checkpoint_name(2)]
    assert direct(s3, url).manifest(checkpoint_name(3))["metric"]["value"] == 0.5
    assert all(seconds >= FIRST_WAIT_S for seconds in waited.values()), waited  # each one met the outage and waited


@pytest.mark.slow
def test_past_the_deadline_each_request_names_what_it_was_doing(s3, proxied):
    url, proxy = proxied
    options = {"client_kwargs": {"endpoint_url": proxy.url}, **QUICK}
    store, io = CheckpointStore(url, options, outage_deadline_s=2), AtomicCheckpointIO(options, outage_deadline_s=2)
    name = checkpoint_name(7)
    io.save_checkpoint({"global_step": 7}, store.url_of(name, STATE))
    store.finish(name, {STATE: io.written.pop(store.url_of(name, STATE))}, {"step": 7})
    proxy.cut()
    for operation, doing in (
        (lambda: io.save_checkpoint({"global_step": 8}, store.url_of(checkpoint_name(8), STATE)),
         f"saving step 8 to {url}/{checkpoint_name(8)}/{STATE}"),
        (lambda: store.finish(checkpoint_name(8), {}, {"step": 8}), f"saving step 8 to {url}/{checkpoint_name(8)} (its {MARKER})"),
        (store.complete, f"listing the checkpoints in {url}"),
        (lambda: store.problem(name), f"reading checkpoint {url}/{name}"),
        (lambda: io.load_checkpoint(store.url_of(name, STATE)), f"reading checkpoint {url}/{name}/{STATE}"),
        (lambda: store.delete(name), f"deleting checkpoint {url}/{name}"),
    ):
        with pytest.raises(StoreUnreachable, match="the object store did not answer for") as caught:
            operation()
        assert doing in str(caught.value) and "checkpoint.outage_deadline_s: 2 s" in str(caught.value)
    proxy.restore()
    assert direct(s3, url).complete() == [name] and direct(s3, url).problem(name) is None


def test_an_upload_that_fails_half_way_leaves_no_object(s3):
    """Closing an unfinished upload would publish what was written so far: a truncated file at the final key."""
    fs, root = filesystem(f"s3://{s3.bucket}/partial", {"client_kwargs": {"endpoint_url": s3.endpoint}})

    def write(f):
        f.write(b"x" * (3 << 20))
        raise RuntimeError("the serialiser failed half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        write_atomically(fs, f"{root}/{STATE}", write)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{STATE}")
    entry = write_atomically(fs, f"{root}/{STATE}", lambda f: f.write(b"whole"))
    assert entry == FileEntry(5, hashlib.sha256(b"whole").hexdigest()) and fs.cat(f"{root}/{STATE}") == b"whole"
