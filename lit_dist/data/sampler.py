"""A distributed batch sampler that gives every rank the same number of one-bucket batches.

Why not ``DistributedSampler`` + ``BatchSampler``: ranks would build batches
independently, so a batch could mix image sizes, and ranks could end an epoch
with different batch counts and deadlock in the next collective. Here whole
*global* batches (``batch_size_per_device x world_size`` samples of one bucket)
are formed from one shuffle that depends only on (seed, epoch), and each rank
takes its slice of every global batch: equal counts by construction.

The class subclasses ``DistributedSampler`` only so that Lightning recognises it
as already distributed and does not wrap it in a sampler of its own.
"""

import copy
from collections.abc import Iterator

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from lit_dist.data.permutation import permute, permute_blocks


class BucketBatchSampler(DistributedSampler):
    """Yields ``(epoch, indices, weight)``: one batch of this rank, all from one bucket.

    Training (``shuffle=True``): every rank gets ``len(self)`` batches of exactly
    ``batch_size_per_device`` samples. Samples of a bucket that do not fill a
    global batch are left for this epoch, and which ones rotates from epoch to
    epoch, so none is left out for good.

    Evaluation (``shuffle=False``): every sample is yielded exactly once across
    ranks with weight 1, in bucket order. Ranks short of the largest batch count
    are padded with repeats of one of their batches with weight 0, so every rank
    runs the same number of steps (and reaches the same collectives) while
    metrics still count each sample once.
    """

    def __init__(
        self,
        bucket_ids: np.ndarray,
        batch_size_per_device: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        repeats: np.ndarray | int = 1,
        group_source: np.ndarray | None = None,
        source_weights: np.ndarray | None = None,
        shuffle_block: int = 1,
    ):
        # DistributedSampler's own __init__ would query the process group; set what it sets instead.
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batch_size_per_device = batch_size_per_device
        self.bucket_ids = np.asarray(bucket_ids)  # any integer dtype; int16 from assign_buckets
        counts = np.bincount(self.bucket_ids) if len(self.bucket_ids) else np.zeros(0, dtype=np.int64)
        order = _group_rows(self.bucket_ids, counts)
        present = np.flatnonzero(counts)
        self.groups = present  # the bucket id of each entry of `members`: it keys that bucket's permutations
        self.members = [m for m in np.split(order, np.cumsum(counts)[:-1]) if len(m)]  # rows of each bucket, in order
        # Mixing datasets: bucket ids are groups (dataset x bucket); each group belongs to a source,
        # and the sources' weights set their shares of every epoch's batches.
        self.member_source = None if group_source is None else np.asarray(group_source)[present]
        self.source_weights = None if source_weights is None else np.asarray(source_weights, dtype=np.float64)
        per_bucket = np.asarray(repeats, dtype=np.int64)  # a scalar, or one entry per bucket id
        times = per_bucket[present] if per_bucket.ndim else np.full(len(present), int(per_bucket))
        self.repeats = times if shuffle else np.ones(len(present), dtype=np.int64)
        # > 1: a bucket's samples are shuffled in runs of this many neighbours (rows in the table's order: a tar
        # shard's or an Arrow file's samples lie in it side by side), so that a rank's batch is a few runs that the
        # dataset reads with one request each instead of one request per sample.
        self.shuffle_block = shuffle_block
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches done) of a mid-epoch checkpoint
        self._replanned: tuple[int, np.ndarray] | None = None  # (epoch, this rank's batches) after a batch change
        # After a resume that re-planned an epoch: that epoch, the parts of it trained with other global
        # batch sizes, and the trainer's batch count where the current part's plan began.
        self._position: dict | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size_per_device * self.num_replicas

    def __len__(self) -> int:
        if self.shuffle:
            return sum(len(m) * int(r) // self.global_batch_size for m, r in zip(self.members, self.repeats, strict=True))
        batches = sum(-(-len(m) // self.batch_size_per_device) for m in self.members)
        return -(-batches // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume(self, epoch: int, batches_done: int, global_batch_size: int | None = None,
               earlier: list | tuple = ()) -> tuple[int, int]:
        """Skip the first ``batches_done`` global batches the next time ``epoch`` is iterated (and only then).

        ``global_batch_size`` is the checkpoint's, and ``earlier`` the (global batch size, batches
        trained) of parts of this epoch that ran with yet other sizes before it. When the sizes
        differ from this sampler's (world size or batch size changed), the rest of the epoch's
        plan is regrouped into global batches of the new size: no sample of the epoch is trained
        twice. Returns (batches this epoch has left, samples that fill no whole batch and wait for
        a later epoch).
        """
        saved = global_batch_size or self.global_batch_size
        if not self.replans(batches_done, saved, earlier):
            self._resume_at = (epoch, batches_done)
            return len(self) - batches_done, 0
        segments = [*map(tuple, earlier), (saved, batches_done)]
        rest, left = self._plan_after(epoch, segments)
        if saved != self.global_batch_size:
            rest, left = self._regroup(rest, epoch, len(segments))
        b = self.batch_size_per_device
        self._replanned = (epoch, rest[:, self.rank * b : (self.rank + 1) * b])
        return len(rest), left

    def resume_from(self, state: dict) -> tuple[int | None, str | None]:
        """Resume at a saved position (``position``'s dict). Returns where the trainer's count of the epoch's
        batches must stand for the epoch to end after the batches it has left (None: where it was saved),
        and a message for the user when the rest of the epoch was re-planned."""
        epoch, done = state["epoch"], state["batches_done"]
        saved, earlier = state.get("global_batch_size", self.global_batch_size), state.get("earlier", [])
        self.set_epoch(epoch)
        left, waiting = self.resume(epoch, done, saved, earlier)
        if not self.replans(done, saved, earlier):
            return None, None
        message = None
        if saved != self.global_batch_size:  # a new part of the epoch starts, at batch 0
            earlier, done = [*earlier, [saved, done]], 0
            message = (f"lit-dist: resuming epoch {epoch} with a global batch of {self.global_batch_size} samples "
                       f"(data.batch_size_per_device x world size); the checkpoint's was {saved}. The batches "
                       f"trained stand; the epoch's other samples are regrouped into {left} batches of the new "
                       f"size, none trained twice ({waiting} that fill no whole batch wait for a later epoch).")
        # The trainer ends the epoch when its count of batches reaches this sampler's length.
        start = len(self) - left
        self._position = {"epoch": epoch, "earlier": earlier, "offset": start - done}
        return start, message

    def position(self, epoch: int, batches_done: int) -> dict:
        """What to save to resume after ``batches_done`` batches of ``epoch`` (the trainer's count)."""
        state = {"epoch": epoch, "batches_done": batches_done, "global_batch_size": self.global_batch_size}
        replan = self._position if self._position and self._position["epoch"] == epoch else None
        if replan is not None:
            state.update(batches_done=batches_done - replan["offset"], earlier=replan["earlier"])
        return state

    def replans(self, batches_done: int, global_batch_size: int, earlier: list | tuple = ()) -> bool:
        """Whether resuming there needs another plan than the epoch's own: part of the epoch was
        trained with another global batch size."""
        return bool(earlier) or (global_batch_size != self.global_batch_size and batches_done > 0)

    def _plan_after(self, epoch: int, segments: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        """The global batches of ``epoch`` not yet trained after ``segments`` (global batch size, batches
        trained), each part regrouped from the rest of the one before; and the samples the last
        regrouping left over.

        The first plan is recomputed as a world of one rank holding whole global batches (a global
        batch's composition and the batch order depend on its size only, not on how ranks split it).
        """
        planner = copy.copy(self)
        planner.batch_size_per_device, planner.num_replicas, planner.rank, planner.epoch = segments[0][0], 1, 0, epoch
        plan, left = planner._train_batches(), 0
        for step, (size, _) in enumerate(segments[1:], start=1):
            plan, left = self._regroup(plan[segments[step - 1][1] :], epoch, step, size)
        return plan[segments[-1][1] :], left

    def _regroup(self, rest: np.ndarray, epoch: int, step: int, size: int | None = None) -> tuple[np.ndarray, int]:
        """The samples of global batches ``rest`` as global batches of ``size`` (default: this sampler's),
        still one bucket each, in a new order: (batches, samples that fill none)."""
        g = size or self.global_batch_size
        groups = self.bucket_ids[rest[:, 0]] if len(rest) else np.zeros(0, dtype=np.int64)
        regrouped, left = [], 0
        for group in np.unique(groups):
            samples = rest[groups == group].ravel()  # in the earlier plan's order
            whole = len(samples) - len(samples) % g
            regrouped.append(samples[:whole].reshape(-1, g))
            left += len(samples) - whole
        if not regrouped:
            return np.zeros((0, g), dtype=np.int64), left
        stacked = np.concatenate(regrouped)
        return stacked[np.random.default_rng([self.seed, epoch, 2, step]).permutation(len(stacked))], left

    def __iter__(self) -> Iterator[tuple[int, list[int], float]]:
        if self.shuffle:
            if self._replanned is not None and self._replanned[0] == self.epoch:
                batches, self._replanned = self._replanned[1], None
                for batch in batches:
                    yield self.epoch, batch.tolist(), 1.0
                return
            # Resuming mid-epoch skips the batches already trained on: the plan is recomputed from
            # (seed, epoch), so nothing is decoded or replayed to get back to the position.
            start = self._resume_at[1] if self._resume_at and self._resume_at[0] == self.epoch else 0
            self._resume_at = None
            for batch in self._train_batches()[start:]:
                yield self.epoch, batch.tolist(), 1.0
            return
        b = self.batch_size_per_device
        everything = [m[i : i + b] for m in self.members for i in range(0, len(m), b)]
        mine = everything[self.rank :: self.num_replicas]
        for batch in mine:
            yield self.epoch, batch.tolist(), 1.0
        filler = mine[0] if mine else (everything[0] if everything else None)
        for _ in range(len(self) - len(mine)):
            yield self.epoch, filler.tolist(), 0.0

    def _train_batches(self) -> np.ndarray:
        """This rank's batches for the current epoch, shape (num_batches, batch_size_per_device).

        Only this rank's columns of each bucket's global batches are computed (see
        ``permutation``): the plan costs O(n / world size) per epoch, not O(n).
        """
        b = self.batch_size_per_device
        rows = [self._rank_rows(i, (self.seed, self.epoch), self.epoch) for i in range(len(self.members))]
        if self.source_weights is not None:
            rows = self._weighted(rows)
        if not rows:
            return np.zeros((0, b), dtype=np.int64)
        stacked = np.concatenate(rows)  # (num_global_batches, b): n / world_size entries
        return stacked[np.random.default_rng([self.seed, self.epoch]).permutation(len(stacked))]

    def _rank_rows(self, i: int, key: tuple[int, ...], rotation: int) -> np.ndarray:
        """This rank's slice of every global batch of bucket ``i`` in the shuffle ``key`` names: (global batches, b).

        A bucket's samples (``repeats`` copies of its members, each copy in its own order
        from the seed, or in the table's with ``shuffle_block``) stand in a fixed order. The
        ``n % g`` samples that do not fill a global batch are a window of it that moves by
        ``rotation`` (the epoch), so none is left out for good; the rest are shuffled by ``key``,
        in runs of ``shuffle_block``.
        """
        g, b = self.global_batch_size, self.batch_size_per_device
        members, group = self.members[i], int(self.groups[i])
        size = len(members)
        n = size * int(self.repeats[i])
        leftover = n % g
        batches = (n - leftover) // g
        mine = (np.arange(batches)[:, None] * g + self.rank * b + np.arange(b)).ravel()  # positions in the shuffle
        if self.shuffle_block > 1:
            # Every copy in the table's order: the runs of neighbours are what the shuffle moves.
            shuffled = permute_blocks(mine, n - leftover, self.shuffle_block, (*key, group))
            return members[(rotation * leftover + shuffled) % n % size].reshape(batches, b)
        fixed = (rotation * leftover + permute(mine, n - leftover, (*key, group))) % n  # positions in the fixed order
        copy, within = np.divmod(fixed, size)
        for c in np.unique(copy):
            at = copy == c
            within[at] = permute(within[at], size, (self.seed, group, int(c)))
        return members[within].reshape(batches, b)

    def _weighted(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """Resample whole global batches so each source gets its weight's share of the epoch.

        The epoch keeps its natural length. A source owed more batches than one pass over it
        gives takes further passes, each shuffled from (seed, epoch, source, pass); every rank
        computes the same choice, so batch counts stay equal.
        """
        rng = np.random.default_rng([self.seed, self.epoch, 1])
        sources = np.arange(len(self.source_weights))
        natural = [np.concatenate([r for r, s in zip(rows, self.member_source, strict=True) if s == d] or
                                  [np.zeros((0, self.batch_size_per_device), dtype=np.int64)]) for d in sources]
        total = sum(len(x) for x in natural)
        weights = np.where([len(x) for x in natural], self.source_weights, 0.0)
        share = weights / weights.sum() * total if weights.sum() else np.zeros(len(sources))
        owed = np.floor(share).astype(np.int64)
        owed[np.argsort(-(share - owed), kind="stable")[: total - owed.sum()]] += 1  # largest remainders
        chosen = []
        for d in sources:
            pool, passes = natural[d], 0
            mine = np.flatnonzero(self.member_source == d)
            while len(pool) < owed[d]:
                passes += 1
                key = (self.seed, self.epoch, int(d), passes)
                pool = np.concatenate([pool, *(self._rank_rows(i, key, self.epoch + passes) for i in mine)])
            chosen.append(pool[rng.permutation(len(pool))[: owed[d]]])
        return chosen


def _group_rows(bucket_ids: np.ndarray, counts: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """The rows sorted by bucket, each bucket's rows ascending: a stable counting sort.

    Chunk by chunk, so the only array of n entries is the int32 result (a whole-array
    argsort would add n int64 temporaries, 8 bytes per row at peak); within a chunk a stable
    argsort of 16-bit keys is numpy's radix sort. Chunks of 64 K rows keep the sort's own
    buffers small enough for malloc to reuse: at 1 M rows each sort maps fresh pages
    (15 K page faults per 10 M rows instead of 0.6 K).
    """
    order = np.empty(len(bucket_ids), dtype=np.int32 if len(bucket_ids) < 2**31 else np.int64)
    cursor = np.concatenate(([0], np.cumsum(counts)[:-1]))  # where each bucket's next rows go
    small = len(counts) < 2**15
    for lo in range(0, len(bucket_ids), chunk):
        keys = bucket_ids[lo : lo + chunk]
        keys = keys.astype(np.int16, copy=False) if small else keys
        local = np.argsort(keys, kind="stable")
        sizes = np.bincount(keys, minlength=len(counts))
        pieces = np.split(local, np.cumsum(sizes)[:-1])
        for bucket in np.flatnonzero(sizes):
            rows = pieces[bucket]
            np.add(rows, lo, out=order[cursor[bucket] : cursor[bucket] + len(rows)], casting="unsafe")
            cursor[bucket] += len(rows)
    return order


def plan_buckets(bucket_ids: np.ndarray, bucket_sizes: np.ndarray, global_batch: int, repeats: np.ndarray | int = 1,
                 allow_oversubscription: bool = False) -> tuple[np.ndarray, list[dict], list[str]]:
    """Repeats per bucket, a report row per bucket, and the problems that make training impossible.

    A bucket with fewer than one global batch of samples (after ``repeats``, a scalar or
    one per bucket id) would never yield a batch: that is a problem naming the bucket,
    unless ``allow_oversubscription`` raises its repeats to the minimum that fills one.
    """
    num_buckets = len(bucket_sizes)
    counts = np.bincount(np.asarray(bucket_ids, dtype=np.int64), minlength=num_buckets)
    per_bucket = np.broadcast_to(np.asarray(repeats, dtype=np.int64), (num_buckets,)).copy()
    configured = per_bucket.copy()
    rows, too_small = [], []
    for b in np.flatnonzero(counts):
        n = int(counts[b])
        needed = -(-global_batch // n)
        if n * configured[b] < global_batch:
            too_small.append((b, n, needed))
            if allow_oversubscription:
                per_bucket[b] = needed
        samples = n * int(per_bucket[b])
        rows.append({"group": int(b), "bucket": tuple(int(v) for v in bucket_sizes[b]), "samples": n,
                     "repeats": int(per_bucket[b]), "batches_per_rank": samples // global_batch,
                     "left_for_next_epoch": samples % global_batch})
    problems = []
    if too_small and not allow_oversubscription:
        listed = ", ".join(f"{tuple(int(v) for v in bucket_sizes[b])}: {n} samples" for b, n, _ in too_small)
        most = max(needed for _, _, needed in too_small)
        problems.append(
            f"{len(too_small)} bucket(s) (width, height) have fewer than one global batch of {global_batch} samples "
            f"(data.batch_size_per_device x world size) at their repeats and would never be used: {listed}. "
            f"Set data.repeats >= {most}, lower data.batch_size_per_device, or set data.allow_oversubscription: true "
            "to repeat just these buckets as often as needed"
        )
    return per_bucket, rows, problems
