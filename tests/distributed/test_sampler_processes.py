"""The sampler in several real processes joined by gloo: equal counts, no duplicates, each eval sample once."""

import os
from collections import Counter

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_dist.data.sampler import BucketBatchSampler
from tests.helpers.ports import free_port

pytestmark = pytest.mark.distributed
WORLD = 3


def _worker(rank: int, port: int, bucket_ids: np.ndarray, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    np.random.seed(rank)  # global RNG state differs per process: the sampler must not depend on it
    train = BucketBatchSampler(bucket_ids, 5, WORLD, rank, seed=11)
    train.set_epoch(4)
    evaluation = BucketBatchSampler(bucket_ids, 5, WORLD, rank, shuffle=False)
    mine = {"train": [b for _, b, _ in train], "eval": [(b, w) for _, b, w in evaluation]}
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def test_ranks_in_separate_processes_split_the_data_exactly():
    bucket_ids = np.random.default_rng(0).integers(0, 6, size=997)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, bucket_ids, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    gathered = queue.get(timeout=120)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len({len(g["train"]) for g in gathered}) == 1 and len({len(g["eval"]) for g in gathered}) == 1
    trained = Counter(i for g in gathered for batch in g["train"] for i in batch)
    assert max(trained.values()) == 1, "a sample went to two ranks"
    for g in gathered:
        for batch in g["train"]:
            assert len(set(bucket_ids[batch])) == 1
    evaluated = Counter(i for g in gathered for batch, weight in g["eval"] if weight for i in batch)
    assert evaluated == Counter(range(len(bucket_ids)))
