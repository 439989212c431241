"""The object store goes away mid-run, made the way it happens: the real local S3 server behind a TCP proxy that
the test cuts (connections reset, new ones refused) and restores. A short outage costs only its length and every
sample is the one the sampler chose; a long one stops every rank with exit 17 ("retry later") and one line, and
nothing of the run is left."""

import json
import time
from urllib.parse import urlparse

import pytest
import torch

from lit_dist.errors import ExitCode
from tests.conftest import CONFIGS, start_module
from tests.helpers.processes import Output, finish, left_after
from tests.helpers.tcp_proxy import TcpProxy
from tests.s3.outages import QUICK, SECOND_WAIT, WAITED_TWICE_S, restored_on

# Mostly waiting on outages and deadlines: beside the parallel tests, in .ci/test's second process (as the checkpoint
# outages are).
pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.beside]
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "PYTHONFAULTHANDLER": "1"}


@pytest.fixture
def proxied(s3, demo_data):
    s3.put(str(demo_data.parent), f"{s3.bucket}/shapes", recursive=True)
    endpoint = urlparse(s3.endpoint)
    proxy = TcpProxy((endpoint.hostname, endpoint.port))
    yield f"s3://{s3.bucket}/shapes", proxy
    proxy.close()


def start(tmp_path, url, proxy, run_id, *extra):
    """A quickstart fit reading its table and images through the proxy, in a session of its own."""
    args = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", f"{url}/metadata.parquet",
            "--data.create_demo_if_missing", "false",
            "--data.storage_options", json.dumps({"client_kwargs": {"endpoint_url": proxy.url}, **QUICK}),
            "--data.batch_size_per_device", "8", "--data.num_workers", "1", "--trainer.max_steps", "30",
            "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false", "--run.root_dir", str(tmp_path),
            "--run.run_id", run_id, "--export.filename", "null",
            "--trainer.callbacks+=tests.helpers.recorder.RowRecorder", *extra]
    return start_module("lit_dist", *args, env=ENV)


def test_a_short_outage_costs_its_length_and_no_sample_is_substituted(tmp_path, proxied):
    url, proxy = proxied
    code, _, err = finish(start(tmp_path, url, proxy, "calm"))
    assert code == 0, err[-3000:]
    marker = tmp_path / "cut-now"
    proc = start(tmp_path, url, proxy, "outage", "--trainer.callbacks+=tests.helpers.recorder.MarkAtStep",
                 "--trainer.callbacks.step", "8", "--trainer.callbacks.path", str(marker))
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proxy.cut()
    output = Output(proc)
    assert output.wait_for(SECOND_WAIT), output.tail()  # a read has waited twice (1 s, 2 s)
    # The case: a store away for 15 s (this one test waits it out in full; the others restore the store
    # once lit-dist has waited twice, which exercises the same code in a few seconds).
    time.sleep(15 - WAITED_TWICE_S)
    proxy.restore()
    code, _, err = output.finish()
    assert code == 0, err[-3000:]
    assert "the object store does not answer" in err, err[-3000:]  # it said what it waited for
    assert "using another" not in err and "unreadable" not in err, err[-3000:]
    rows = [json.loads((tmp_path / "quickstart" / run / "rows-rank0.json").read_text()) for run in ("calm", "outage")]
    assert rows[0] == rows[1]  # every batch holds the samples the sampler chose, as without the outage


def test_an_outage_past_its_deadline_stops_every_rank_with_exit_17_and_nothing_is_left(tmp_path, proxied):
    url, proxy = proxied
    marker = tmp_path / "cut-now"
    proc = start(tmp_path, url, proxy, "gone", "--data.outage_deadline_s", "5", "--trainer.devices", "2",
                 "--trainer.strategy", "ddp", "--trainer.max_steps", "1000",
                 "--trainer.callbacks+=tests.helpers.recorder.MarkAtStep", "--trainer.callbacks.step", "4",
                 "--trainer.callbacks.path", str(marker))
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.05)
    proxy.cut()
    started = time.monotonic()
    code, _, err = finish(proc)
    elapsed = time.monotonic() - started
    left = left_after(proc.pid, 10)
    assert code == ExitCode.STORE_UNREACHABLE, err[-3000:]
    assert "lit-dist: error: rank" in err and "the object store did not answer for" in err, err[-3000:]
    assert "retry the job later" in err and "Traceback" not in err, err[-3000:]
    assert elapsed < 5 + 60, elapsed  # the deadline, one last attempt (a few seconds each), the other rank's grace
    assert not left, left


def test_one_process_with_loader_workers_is_gone_within_seconds_of_its_outage_line(tmp_path, proxied):
    # The quickstart as it ships, one process with loader workers, the store frozen (connections accepted, no byte
    # moving). When the first worker gives up, the other is still waiting out its own read.
    url, proxy = proxied
    marker = tmp_path / "cut-now"
    proc = start(tmp_path, url, proxy, "gone", "--data.outage_deadline_s", "20", "--trainer.max_steps", "1000",
                 "--trainer.callbacks+=tests.helpers.recorder.MarkAtStep", "--trainer.callbacks.step", "4",
                 "--trainer.callbacks.path", str(marker), "--data.num_workers", "2")
    while not marker.exists() and proc.poll() is None:
        time.sleep(0.05)
    proxy.silence()
    output = Output(proc)
    code, _, err = output.finish(timeout=240)
    assert code == ExitCode.STORE_UNREACHABLE and "Traceback" not in err, err[-3000:]
    assert output.seconds_after("lit-dist: error:") < 8, err[-3000:]
    assert not left_after(proc.pid, 10)


def test_a_cache_on_s3_waits_out_an_outage_and_then_says_retry_later(s3, demo_data):
    from lit_dist.cache.config import CacheConfig
    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.runtime.outage import StoreUnreachable

    encoder = {"class_path": "tests.helpers.encoders.TinyEncoder", "init_args": {"seed": 1}}
    url = f"s3://{s3.bucket}/cache"
    endpoint = urlparse(s3.endpoint)
    proxy = TcpProxy((endpoint.hostname, endpoint.port))

    def module(mode, options, deadline_s=180.0):
        dm = BucketDataModule(str(demo_data), resolution=32, batch_size_per_device=8, num_workers=0,
                              storage_options=options, outage_deadline_s=deadline_s,
                              cache=CacheConfig(dir=url, mode=mode, encoder=encoder, shard_size_mb=1))
        dm.setup("fit")
        return dm._splits["train"].cache["pixels"]

    try:
        module("build", {"client_kwargs": {"endpoint_url": s3.endpoint}})
        view = module("read", {"client_kwargs": {"endpoint_url": proxy.url}, **QUICK})
        assert view.outage_deadline_s == 180.0  # the data module's deadline reached the cache's reader
        expected = view.read(17)
        proxy.cut()
        started = time.monotonic()
        with restored_on(proxy):  # once the read has waited twice (1 s, 2 s)
            assert (view.read(17) == expected).all()  # the same entry, read once the store answered again
        assert time.monotonic() - started >= WAITED_TWICE_S
        proxy.cut()
        view.outage_deadline_s = 3.0  # what data.outage_deadline_s: 3 gives a view (checked above: 180 by default)
        with pytest.raises(StoreUnreachable, match=r"the object store did not answer .* \(cache field pixels\)"):
            view.read(18)
    finally:
        proxy.close()


def test_tar_shards_read_in_runs_wait_out_an_outage_and_then_say_retry_later(s3, demo_data, tmp_path):
    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.runtime.outage import StoreUnreachable
    from tests.helpers.tar_shards import save_shapes

    save_shapes(str(demo_data), tmp_path / "tars", per_shard=200)
    s3.put(str(tmp_path / "tars"), f"{s3.bucket}/tars", recursive=True)
    endpoint = urlparse(s3.endpoint)
    proxy = TcpProxy((endpoint.hostname, endpoint.port))
    try:
        dm = BucketDataModule(webdataset=f"s3://{s3.bucket}/tars/{{00000..00001}}.tar", resolution=32,
                              batch_size_per_device=8, shuffle_block=8, num_workers=0, node_index_dir=None,
                              index_cache=str(tmp_path / "index.parquet"), cache=None,
                              storage_options={"client_kwargs": {"endpoint_url": proxy.url}, **QUICK})
        dm.prepare_data()
        dm.setup("fit")
        dataset = dm._splits["train"]
        request = next(iter(dm.train_dataloader().sampler))  # (epoch, a batch of 8 neighbours, weight)
        expected = dataset[request]
        proxy.cut()
        started = time.monotonic()
        with restored_on(proxy):  # once the read has waited twice (1 s, 2 s)
            again = dataset[request]
        assert time.monotonic() - started >= WAITED_TWICE_S
        assert torch.equal(again["image"], expected["image"]) and int(again["bad_samples"]) == 0
        proxy.cut()
        dataset.outage_deadline_s = 3.0
        with pytest.raises(StoreUnreachable, match=r"the object store did not answer .*\.tar"):
            dataset[request]
    finally:
        proxy.close()


def test_the_table_is_read_once_the_store_answers_again(proxied):
    from lit_dist.data.metadata import read_metadata

    url, proxy = proxied
    proxy.cut()
    started = time.monotonic()
    with restored_on(proxy):  # once the read has waited twice (1 s, 2 s)
        meta = read_metadata(f"{url}/metadata.parquet", {"client_kwargs": {"endpoint_url": proxy.url}})
    # Waited, then read: not a "damaged table" (exit 3).
    assert len(meta) == 400 and time.monotonic() - started >= WAITED_TWICE_S
