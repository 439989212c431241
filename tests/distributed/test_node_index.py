"""One metadata index per node, in 2 real processes joined by gloo on one host (one node): the first rank
reads the table and writes its columns into the node's folder, both ranks map them (the mapping is in each
process's /proc/self/maps), each rank's epoch is exactly the one it gets reading the table itself, and the
folder is gone once both have mapped it. Without a usable folder every rank reads the table, as before."""

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_dist.data.node_index import PREFIX
from tests.helpers.ports import free_port

pytestmark = pytest.mark.distributed
WORLD = 2


def _worker(rank: int, port: int, metadata: str, node_index_dir, queue, nodes: bool = False) -> None:
    from lit_dist.data.datamodule import BucketDataModule

    if nodes:  # each rank a node of its own, and rank 1's folder unusable: one node shares, the other falls back
        import socket

        import lit_dist.data.node_index as node_index

        socket.gethostname = lambda: f"node{rank}"
        if rank == 1:
            node_index.os.access = lambda path, mode: False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        dm = BucketDataModule(metadata, resolution=32, batch_size_per_device=4, num_workers=0,
                              node_index_dir=node_index_dir)
        dm.setup("fit")
        sampler = dm.train_sampler(WORLD, rank)
        sampler.set_epoch(3)
        batches = [batch for _, batch, _ in sampler]
        dataset = dm._splits["train"]
        names = dataset.filenames.take(dataset.positions[:5]).to_pylist()
        with open("/proc/self/maps") as f:
            mapped = sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                             for line in f if PREFIX in line})
        queue.put((rank, batches, names, mapped, dm.classes))
    finally:
        dist.destroy_process_group()


def run(metadata, node_index_dir, nodes: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, str(metadata), node_index_dir, queue, nodes))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, *rest = queue.get(timeout=120)
            results[rank] = rest
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:  # a rank that hangs must not outlive the test
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


@pytest.fixture(scope="module")
def private(demo_data) -> dict:
    """What each rank gets reading the table itself (no node_index_dir): what every test compares with."""
    return run(demo_data, None)


def test_the_node_reads_the_table_once_and_every_rank_gets_the_epoch_it_would_read_itself(tmp_path, demo_data,
                                                                                           private):
    shm = tmp_path / "shm"
    shm.mkdir()
    # What a killed run left: an index folder whose owner process is gone. The next start removes it.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = shm / f"{PREFIX}stale-node0"
    stale.mkdir()
    (stale / "owner.json").write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    shared = run(demo_data, str(shm))
    for rank in range(WORLD):
        batches, names, mapped, classes = shared[rank]
        assert mapped and all(str(shm) in path for path in mapped), f"rank {rank} maps the node's index: {mapped}"
        assert (batches, names, classes) == tuple(private[rank][:2]) + (private[rank][3],), \
            f"rank {rank}'s epoch differs from reading the table itself"
        assert private[rank][2] == [], "without node_index_dir nothing is mapped"
    assert sum(len(b) for rank in range(WORLD) for b in shared[rank][0]) > 0
    assert os.listdir(shm) == [], "the index folder is removed once mapped; the stale one at the start"


def test_without_a_usable_folder_every_rank_reads_the_table(tmp_path, demo_data, capfd, private):
    results = run(demo_data, str(tmp_path / "missing"))
    for rank in range(WORLD):
        assert results[rank][2] == [] and results[rank][:2] == private[rank][:2]
    err = capfd.readouterr().err
    assert "every rank reads the metadata itself (no shared index: " in err and "is not a writable folder" in err, err


def test_a_node_that_falls_back_runs_the_same_collectives_as_one_that_shares(tmp_path, demo_data, capfd, private):
    shm = tmp_path / "shm"
    shm.mkdir()
    mixed = run(demo_data, str(shm), nodes=True)  # a mismatch of collectives would hang here (the queue's timeout)
    assert mixed[0][2] and mixed[1][2] == [], "node0 maps its index, node1 reads the table itself"
    for rank in range(WORLD):
        assert mixed[rank][:2] == private[rank][:2]
    assert "lit-dist: node node1: every rank reads the metadata itself" in capfd.readouterr().err
    assert os.listdir(shm) == []


def _failing_worker(rank: int, port: int, metadata: str, node_index_dir, queue) -> None:
    import time

    import lit_dist.data.node_index as node_index
    from lit_dist.data.datamodule import BucketDataModule

    def write(*_):  # what a table Arrow cannot write, or a bug, raises: not an OSError
        raise TypeError("injected: an extra column of mixed types")

    if rank == 0:
        node_index.write = write
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    began = time.monotonic()
    try:
        BucketDataModule(metadata, resolution=32, batch_size_per_device=4, num_workers=0,
                         node_index_dir=node_index_dir).setup("fit")
        queue.put((rank, None, time.monotonic() - began))
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the test's finding
        queue.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - began))
    finally:
        dist.destroy_process_group()


def test_an_error_other_than_oserror_writing_the_index_reaches_every_rank(tmp_path, demo_data):
    # The node's first rank wrote the index outside the guard that hands its errors to the others: they waited in
    # the gather for the collective timeout (30 minutes).
    shm = tmp_path / "shm"
    shm.mkdir()
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_failing_worker, args=(r, port, str(demo_data), str(shm), queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        said = dict((rank, (error, seconds)) for rank, error, seconds in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert said[0][0] == "TypeError: injected: an extra column of mixed types", said
    assert said[1][0] == "RuntimeError: reading the metadata failed on rank 0: TypeError: injected: an extra column " \
                         "of mixed types", said
    assert said[1][1] < 30, said  # at once, not at a timeout
