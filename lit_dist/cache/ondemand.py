"""``data.cache.mode: ondemand``: fill the cache while training, and read it from the next epoch on.

What the cache lacks is made where it is needed: pixels in the loader workers (decoded as
without a cache, then sent along with the batch), encoder outputs on the rank's device just
before ``forward`` (a batch with any output missing is encoded whole, rounded to the stored
dtype, so it trains on exactly what the cache will hold). The training process hands the new
entries to a background thread that writes shards (atomically, listed in its pending list, as a
build does). At the start of every epoch, and at the end of training, all ranks flush, rank 0
publishes, and every rank re-reads the index: the next epoch reads what the last one made.
Loader workers restart every epoch in this mode (they carry the lookups of the epoch they began).
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from lit_dist.cache.build import _encode
from lit_dist.cache.shards import ShardWriter, from_stored
from lit_dist.cache.store import new_build_id
from lit_dist.runtime.distributed import Comm


class FillKeys:
    """What a loader worker needs to name the entries it makes: sample id and key per table position."""

    def __init__(self, samples: np.ndarray, keys: dict[str, np.ndarray]):
        self.samples, self.keys = samples, keys  # keys by batch key ("pixels", "latent")

    def take(self, positions: np.ndarray) -> "FillKeys":
        return FillKeys(self.samples[positions], {k: v[positions] for k, v in self.keys.items()})

    def batch_parts(self, arrays: dict[str, list], at: np.ndarray, dtypes: dict[str, str]) -> dict:
        """Move the worker's new arrays out of ``arrays`` ((slot, value) lists) into batch entries for the
        training process: ``_fill`` (pixel entries to write) and ``_encode`` (rows the device must encode,
        with the cached rows of the same field, which it fills in around them)."""
        parts = {}
        fills = arrays.pop("_fill_pixels", [])
        if fills:
            parts["_fill"] = [(int(self.samples[p]), int(self.keys["pixels"][p]), torch.from_numpy(np.ascontiguousarray(a)))
                              for _, (p, a) in fills]
        inputs = arrays.pop("_encode_input", [])
        if inputs:

            key = next(k for k in self.keys if k != "pixels")
            positions = np.array([p for _, (p, _) in inputs])
            cached = arrays.pop(key, [])
            parts["_encode"] = {
                "input": torch.from_numpy(np.stack([c for _, (_, c) in inputs])),  # (k, H, W, 3) uint8 centre crops
                "slots": torch.tensor([slot for slot, _ in inputs]),
                "sample": torch.from_numpy(self.samples[positions].view(np.int64)),
                "key": torch.from_numpy(self.keys[key][positions].view(np.int64)),
                "size": len(at),
            }
            if cached:
                parts["_encode"]["cached_slots"] = torch.tensor([slot for slot, _ in cached])
                parts["_encode"]["cached"] = from_stored(np.stack([a for _, a in cached]), dtypes[key])
        return parts


class OnDemandFill:
    """Takes new entries from batches, writes them in the background, publishes them at epoch boundaries
    (the run control calls ``sync`` there: ``connect``)."""

    def __init__(self, plan, views: list[dict]):
        self.plan, self.views = plan, views
        self.comm: Comm | None = None
        self.build = new_build_id()
        self.written: dict[str, list[dict]] = {name: [] for name in plan.fields}
        self.writers = {name: self.plan.writer(name) for name in plan.fields}
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lit-dist-cache-fill")
        self.pending = []
        self.seen: dict[str, set] = {name: set() for name in plan.fields}  # (sample, key) made this epoch
        self.encoder = plan.encoder
        self.made = 0
        self.connected = False

    # -- batches (training process) ---------------------------------------------------------

    def take(self, batch: dict) -> None:
        """Before the batch moves to the device: its new pixel entries go to the writer."""
        for sample, key, array in batch.pop("_fill", ()):
            self._add("pixels", sample, key, array.numpy())

    def encode(self, batch: dict, encoder_key: str, device: torch.device) -> None:
        """On the device: encoder outputs of the rows the cache lacks, in the stored dtype (what the cache will
        hold), placed among the batch's cached rows; the new ones go to the writer."""

        job = batch.pop("_encode")
        if next(self.encoder.parameters(), torch.zeros(0)).device != device:
            self.encoder.to(device)
        dtype = self.plan.config.encoder_dtype
        stored = _encode(self.encoder, job["input"], self.plan, dtype)
        for sample, key, array in zip(job["sample"].cpu().numpy().view(np.uint64), job["key"].cpu().numpy().view(np.uint64),
                                      stored, strict=True):
            self._add("encoder", int(sample), int(key), array)
        made = from_stored(np.stack(stored), dtype).to(device)  # (k, ...)
        out = torch.empty((int(job["size"]), *made.shape[1:]), dtype=made.dtype, device=device)
        out[job["slots"]] = made
        if "cached" in job:
            out[job["cached_slots"]] = job["cached"]
        batch[encoder_key] = out

    def _add(self, name: str, sample: int, key: int, array: np.ndarray) -> None:
        with self.lock:
            if (sample, key) in self.seen[name]:  # repeats, padding batches: each entry once
                return
            self.seen[name].add((sample, key))
            self.writers[name].add(sample, key, array)
            self.made += 1
            if self.writers[name].nbytes >= self.plan.config.shard_size_mb * 1_000_000:
                self._submit(name)

    def _submit(self, name: str) -> None:
        writer, self.writers[name] = self.writers[name], self.plan.writer(name)
        if len(writer):
            self.pending.append(self.pool.submit(self._write, name, writer))

    def _write(self, name: str, writer: ShardWriter) -> None:
        samples, raw, entries = writer.samples, writer.raw_bytes, len(writer)
        data, index = writer.finish()
        store = self.plan.store
        self.written[name].append(store.write_shard(name, self.plan.fingerprints[name], data, index, raw, samples,
                                                    entries, writer.encoding))
        store.record_pending(name, self.build, self.comm.rank if self.comm else 0, self.written[name])

    # -- epoch boundaries (every rank) ---------------------------------------------------------

    def connect(self, control) -> None:
        self.connected = True
        control.at_epoch_start(lambda trainer: self.sync())
        control.at_train_end(lambda trainer: self.sync())

    def sync(self) -> None:
        """Flush every rank's new entries, publish them (rank 0), and point the lookups at them."""
        self.comm = self.comm or Comm.current()
        with self.lock:
            for name in self.plan.fields:
                self._submit(name)
        for job in self.pending:
            job.result()
        self.pending = []
        made = sum(self.comm.all_gather(self.made))
        if not made:
            return
        self.comm.barrier()  # every rank's pending list is written
        self.comm.on_rank_zero(lambda: [self.plan.store.publish(name) for name in self.plan.fields],
                               "publishing the cache")
        self.written = {name: [] for name in self.plan.fields}
        # Published entries are looked up from now on; what a later epoch makes is new: the set stays one epoch's.
        self.seen = {name: set() for name in self.plan.fields}
        self.made = 0
        found, _ = self.plan.match()
        for views, fresh in zip(self.views, self.plan.views(found), strict=True):
            for key, view in views.items():  # the datasets hold these view objects: they see the new entries
                new = fresh[key]
                view.urls, view.shard, view.offset, view.length, view.crc = new.urls, new.shard, new.offset, new.length, new.crc
                view.encodings = new.encodings
