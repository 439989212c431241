from collections import Counter

import numpy as np
import pytest

from lit_dist.data.sampler import BucketBatchSampler


def epoch_batches(bucket_ids, batch, world, epoch, shuffle=True, seed=0, shuffle_block=1):
    out = []
    for rank in range(world):
        sampler = BucketBatchSampler(bucket_ids, batch, world, rank, seed=seed, shuffle=shuffle,
                                     shuffle_block=shuffle_block)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(out[-1]) == len(sampler)
    return out


@pytest.mark.parametrize("shuffle_block", [1, 7])
@pytest.mark.parametrize("seed", range(8))
def test_every_rank_gets_the_same_number_of_one_bucket_batches(seed, shuffle_block):
    rng = np.random.default_rng(seed)
    bucket_ids = rng.integers(0, rng.integers(1, 9), size=rng.integers(50, 3000))
    batch, world = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    per_rank = epoch_batches(bucket_ids, batch, world, epoch=int(rng.integers(0, 5)), shuffle_block=shuffle_block)
    assert len({len(batches) for batches in per_rank}) == 1
    seen = Counter()
    for batches in per_rank:
        for _epoch, indices, weight in batches:
            assert len(indices) == batch and weight == 1.0
            assert len(set(bucket_ids[indices])) == 1, "a batch mixes buckets"
            seen.update(indices)
    assert all(count == 1 for count in seen.values()), "a sample was dealt twice in one epoch"
    expected = sum((c // (batch * world)) * batch * world for c in np.bincount(bucket_ids))
    assert sum(seen.values()) == expected


def test_order_depends_only_on_seed_and_epoch():
    bucket_ids = np.random.default_rng(0).integers(0, 4, size=500)
    assert epoch_batches(bucket_ids, 4, 2, epoch=3) == epoch_batches(bucket_ids, 4, 2, epoch=3)
    assert epoch_batches(bucket_ids, 4, 2, epoch=3) != epoch_batches(bucket_ids, 4, 2, epoch=4)
    assert epoch_batches(bucket_ids, 4, 2, epoch=3, seed=1) != epoch_batches(bucket_ids, 4, 2, epoch=3)


@pytest.mark.parametrize("shuffle_block", [1, 4])
def test_leftovers_rotate_so_no_sample_is_left_out_for_good(shuffle_block):
    bucket_ids = np.array([0] * 37 + [1] * 23)  # neither fills whole global batches of 8
    used = set()
    for epoch in range(12):
        for batches in epoch_batches(bucket_ids, 4, 2, epoch, shuffle_block=shuffle_block):
            for _epoch, indices, _w in batches:
                used.update(indices)
    assert used == set(range(60))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])
def test_evaluation_counts_each_sample_once_with_equal_steps(world):
    bucket_ids = np.random.default_rng(1).integers(0, 3, size=53)
    per_rank = epoch_batches(bucket_ids, 4, world, epoch=0, shuffle=False)
    assert len({len(batches) for batches in per_rank}) == 1, "ranks would run different step counts"
    counted = Counter()
    for batches in per_rank:
        for _epoch, indices, weight in batches:
            assert len(set(bucket_ids[indices])) == 1
            if weight:
                counted.update(indices)
    assert counted == Counter(range(53))


def test_repeats_multiply_each_bucket_and_oversubscription_fills_small_buckets():
    from lit_dist.data.sampler import plan_buckets

    bucket_ids = np.array([0] * 30 + [1] * 5)
    sizes = np.array([[32, 32], [48, 24]])
    repeats, rows, problems = plan_buckets(bucket_ids, sizes, global_batch=8, repeats=1)
    assert problems and "(48, 24): 5 samples" in problems[0] and "data.repeats >= 2" in problems[0]
    repeats, rows, problems = plan_buckets(bucket_ids, sizes, global_batch=8, repeats=1, allow_oversubscription=True)
    assert not problems and repeats.tolist() == [1, 2]
    sampler = BucketBatchSampler(bucket_ids, 4, 2, 0, repeats=repeats)
    assert len(sampler) == 30 // 8 + 10 // 8
    doubled = BucketBatchSampler(bucket_ids, 4, 1, 0, repeats=2)
    seen = Counter(i for _e, batch, _w in doubled for i in batch)
    assert len(doubled) == 60 // 4 + 10 // 4 and max(seen.values()) == 2


def test_resuming_mid_epoch_yields_exactly_the_rest_of_the_epoch():
    bucket_ids = np.random.default_rng(3).integers(0, 5, size=400)
    full = BucketBatchSampler(bucket_ids, 4, 2, 1, seed=7)
    full.set_epoch(2)
    everything = list(full)
    resumed = BucketBatchSampler(bucket_ids, 4, 2, 1, seed=7)
    resumed.resume(epoch=2, batches_done=5)
    resumed.set_epoch(2)
    assert list(resumed) == everything[5:]
    assert list(resumed) == everything, "the skip applies once"
    finished = BucketBatchSampler(bucket_ids, 4, 2, 1, seed=7)
    finished.resume(epoch=2, batches_done=len(everything))
    finished.set_epoch(3)  # Lightning moves on to the next epoch after an end-of-epoch checkpoint
    assert len(list(finished)) == len(everything)


def test_per_bucket_repeats_work_when_some_buckets_are_empty():
    from lit_dist.data.sampler import plan_buckets

    sizes = np.array([[16, 64], [24, 40], [32, 32], [40, 24], [64, 16]])
    bucket_ids = np.array([2] * 20 + [3] * 3)  # buckets 0, 1 and 4 hold nothing
    repeats, _, problems = plan_buckets(bucket_ids, sizes, global_batch=4, allow_oversubscription=True)
    assert not problems and repeats[3] == 2
    sampler = BucketBatchSampler(bucket_ids, 4, 1, 0, repeats=repeats)
    assert len(list(sampler)) == len(sampler) == 5 + 1


def test_weighted_sources_get_their_share_of_every_epoch_on_every_rank():
    # Two datasets: source 0 owns groups 0-2 (900 samples), source 1 owns groups 3-4 (100 samples).
    groups = np.array([0] * 300 + [1] * 300 + [2] * 300 + [3] * 60 + [4] * 40)
    source = np.array([0, 0, 0, 1, 1])
    per_rank = []
    for rank in range(2):
        sampler = BucketBatchSampler(groups, 4, 2, rank, seed=1, group_source=source, source_weights=np.array([0.5, 0.5]))
        sampler.set_epoch(3)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler)
    assert len(per_rank[0]) == len(per_rank[1])
    from_small = [b for _e, b, _w in per_rank[0] if groups[b[0]] >= 3]
    assert abs(len(from_small) - len(per_rank[0]) / 2) <= 1, "a 50/50 mix must draw half the batches from the small set"
    for (_, a, _), (_, b, _) in zip(per_rank[0], per_rank[1], strict=True):
        assert groups[a[0]] == groups[b[0]], "ranks must be in the same global batch at every step"


def test_rows_grouped_by_bucket_chunk_by_chunk_equal_a_stable_sort():
    from lit_dist.data.sampler import _group_rows

    ids = np.random.default_rng(0).integers(0, 7, 300_001).astype(np.int16)
    ids[ids == 3] = 2  # a bucket with no rows at all
    grouped = _group_rows(ids, np.bincount(ids), chunk=10_000)
    assert np.array_equal(grouped, np.argsort(ids, kind="stable"))


@pytest.mark.parametrize("shuffle_block", [1, 16])
@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 4), (3, 5)])
def test_resuming_on_another_world_size_trains_the_rest_of_the_epoch_once(old_world, new_world, shuffle_block):
    ids = np.random.default_rng(0).integers(0, 5, 1000)
    b, done, epoch = 8, 7, 2

    def ranks(world):
        samplers = [BucketBatchSampler(ids, b, world, r, seed=3, shuffle_block=shuffle_block) for r in range(world)]
        for s in samplers:
            s.set_epoch(epoch)
        return samplers

    before = [list(s) for s in ranks(old_world)]
    whole_epoch = [i for plan in before for _, idx, _ in plan for i in idx]
    trained = [i for plan in before for _, idx, _ in plan[:done] for i in idx]
    after = ranks(new_world)
    outcomes = [s.resume(epoch, done, b * old_world) for s in after]
    assert len(set(outcomes)) == 1, "every rank computes the same re-plan"
    left, waiting = outcomes[0]
    plans = [list(s) for s in after]
    assert all(len(plan) == left for plan in plans), "equal batch counts on every rank"
    for step in zip(*plans, strict=True):  # each global batch: one bucket, whole
        assert len({ids[i] for _, idx, _ in step for i in idx}) == 1 and all(len(idx) == b for _, idx, _ in step)
    rest = [i for plan in plans for _, idx, _ in plan for i in idx]
    assert len(set(trained + rest)) == len(trained) + len(rest), "no sample of the epoch trained twice"
    assert set(rest) <= set(whole_epoch) - set(trained)
    assert len(trained) + len(rest) + waiting == len(whole_epoch) and waiting < 5 * b * new_world
    after[0].set_epoch(epoch + 1)
    assert len(list(after[0])) == len(after[0]), "the next epoch is planned as usual"


def test_resuming_at_an_epoch_start_with_another_world_size_plans_the_epoch_afresh():
    ids = np.random.default_rng(1).integers(0, 3, 300)
    sampler = BucketBatchSampler(ids, 8, 2, 0, seed=3)
    sampler.set_epoch(4)
    assert sampler.resume(4, 0, global_batch_size=32) == (len(sampler), 0)
    fresh = BucketBatchSampler(ids, 8, 2, 0, seed=3)
    fresh.set_epoch(4)
    assert [idx for _, idx, _ in sampler] == [idx for _, idx, _ in fresh]


@pytest.mark.parametrize("repeats", [1, 3])
def test_a_shuffle_in_blocks_gives_each_batch_neighbours_and_moves_them_every_epoch(repeats):
    # Buckets interleaved as an index of tar shards has them: a bucket's neighbours are its next rows in the table.
    ids = np.random.default_rng(2).integers(0, 3, 5000)
    members = [np.flatnonzero(ids == k) for k in range(3)]
    batch, world, block = 8, 2, 16
    firsts = []
    for epoch in (0, 1):
        per_rank = []
        for rank in range(world):
            sampler = BucketBatchSampler(ids, batch, world, rank, seed=5, repeats=repeats, shuffle_block=block)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        runs, batches = 0, 0
        for plan in per_rank:
            for _e, idx, _w in plan:
                at = np.searchsorted(members[ids[idx[0]]], idx)  # places in the bucket's own order
                runs += 1 + int(np.count_nonzero(np.diff(at) != 1))
                batches += 1
        # A batch is one run of neighbours but where a block wraps round the bucket's end (once an epoch a bucket).
        assert runs <= batches + 3 * repeats + 3
        firsts.append([idx for _e, idx, _w in per_rank[0]])
    assert firsts[0] != firsts[1], "the blocks are shuffled anew every epoch"
    whole = [i for idx in firsts[0] for i in idx]
    assert Counter(Counter(whole).values()).keys() <= set(range(1, repeats + 1))


def test_a_shuffle_in_blocks_of_one_is_the_plain_shuffle():
    ids = np.random.default_rng(4).integers(0, 4, 700)
    assert epoch_batches(ids, 4, 2, epoch=1, shuffle_block=1) == epoch_batches(ids, 4, 2, epoch=1)
    assert epoch_batches(ids, 4, 2, epoch=1, shuffle_block=8) != epoch_batches(ids, 4, 2, epoch=1)
