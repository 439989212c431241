"""Building a cache: every rank builds its share of what is missing; rank 0 publishes it.

The same function runs under ``lit-dist cache`` (launched like a training run: srun,
torchrun or ``--trainer.devices N``) and at the start of ``fit`` with ``data.cache.mode:
build``. Order of work, the same on every rank:

1. rank 0 folds the shard lists of earlier, interrupted builds into the manifest and removes
   unlisted shard files; barrier. (``lit_dist.runtime.distributed.Comm`` carries the collectives.)
2. every rank checks its share of the listed shards (sizes, and with ``verify`` their sha256)
   and that it can write; one all-gather; rank 0 drops the damaged shards; barrier.
3. every rank reads the index, computes what is missing (the same list on every rank) and
   takes its share of the batches (equal sample counts, see ``_share``): one bucket per batch, so
   the encoder sees equal shapes.
4. loader workers decode and resize; this process encodes on the rank's device, writes shards
   (atomic, then named in its pending list), and goes on.
5. one all-gather of each rank's outcome: if any rank failed, every rank raises (nobody is
   left waiting); else rank 0 publishes; barrier.
"""

import functools
import logging
import signal
import threading
import time
from collections import OrderedDict, defaultdict

import numpy as np
import torch

from lit_dist.cache.captions import Layout
from lit_dist.cache.plan import CachePlan
from lit_dist.cache.store import new_build_id
from lit_dist.errors import ConfigError, Preempted
from lit_dist.reading.crops import centre_crop
from lit_dist.reading.masks import full, to_grid
from lit_dist.reading.presence import check_files_exist
from lit_dist.reading.tags import ordered
from lit_dist.reading.unreadable import BadImage
from lit_dist.reading.workers import STOP_SIGNALS, Start, context, ignore_stop_signals
from lit_dist.runtime.distributed import Comm
from lit_dist.runtime.slurm import requeue

log = logging.getLogger(__name__)
CAPTION_BATCH = 256  # captions per caption-encoder call while building
# The encodings of captions met before, kept up to this many bytes: a caption repeated in the data (DreamBooth's one
# prompt, class captions) is encoded once per build rather than once per image.
CAPTION_MEMO_BYTES = 256 << 20


def build(plan: CachePlan, device: torch.device, num_workers: int, batch_size: int, verify: bool = False,
          comm: Comm | None = None, progress: bool = True, worker_start: Start = "auto") -> dict:
    """Build what ``plan`` lacks, on every rank; returns rank 0's summary (the same dict on every rank)."""
    comm = comm or Comm.current()
    prepare(plan, comm)
    _drop_damaged(plan, comm, verify)
    found, _ = plan.match()
    # Without a model to batch for, small batches: the ranks' shares come out more even (with 8, 600 images
    # split 304/296 over 2 ranks, and the build waits for the larger share).
    encoding = plan.config.encoder is not None or plan.config.caption_encoder is not None
    work = _work(plan, found, plan.config.encoder_batch_size or (batch_size if encoding else 4))
    check_sources(plan, found, comm)
    mine = _share(work, comm.rank, comm.world)
    started = time.perf_counter()

    def build_share() -> dict:
        outcome = {"samples": 0, "unreadable": 0, "bytes": 0, "raw_bytes": 0, "shards": 0, "preempted": None}
        if work:
            check_encoder(plan, device)
        with _PreemptionFlag() as preempted:
            _run(plan, mine, device, decode_workers(plan, device, num_workers), outcome, comm.rank, progress,
                 preempted, worker_start)
        outcome["preempted"] = preempted.received
        return outcome

    # An error on one rank reaches every rank there: none is left waiting in the publish below.
    outcomes = comm.on_every_rank(build_share, "building the cache")
    comm.on_rank_zero(lambda: [plan.store.publish(name) for name in plan.fields], "publishing the cache")
    total = {k: sum(o[k] for o in outcomes) for k in outcomes[0] if k != "preempted"}
    signals = sorted({o["preempted"] for o in outcomes if o["preempted"]})
    if signals:  # what was built is published; the next run builds the rest
        outcome = comm.on_rank_zero(requeue, "requeueing the job")
        raise Preempted(f"the cache build stopped on {', '.join(signals)} after {total['samples']} samples, which are "
                        f"kept in {plan.config.dir}; {outcome}. The next `lit-dist cache` (or fit with mode build) "
                        "builds only what is missing.")
    return {**total, "needed": sum(len(rows) for _, rows, _ in work), "seconds": time.perf_counter() - started,
            "ranks": comm.world}


class _PreemptionFlag:
    """SIGUSR1 (Slurm's warning before preemption or the time limit) and SIGTERM stop a build between batches:
    the shards written so far are kept and published. Only a flag is set in the handler."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "_PreemptionFlag":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for name in STOP_SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)


def prepare(plan: CachePlan, comm: Comm) -> None:
    """Rank 0 creates the cache, folds in what interrupted builds finished and removes what they left unlisted."""
    def on_rank_zero() -> None:
        plan.store.check(create=True)
        for name in plan.fields:
            plan.store.publish(name)
            plan.store.record_config(name, plan.fingerprints[name], plan.descriptions[name])
        plan.record_captions()

    comm.on_rank_zero(on_rank_zero, "preparing the cache")  # its error, if any, is raised on every rank
    plan.store.check()
    plan.read_captions()


def check_sources(plan: CachePlan, found: list[dict], comm: Comm) -> None:
    """Every rank looks up a sample of the source images the cache lacks (``found``: per dataset, each field's
    entry positions, -1 where missing) before any is decoded: a wrong data.root is a data error now, not a
    loader worker's failure after start-up."""

    def check() -> None:
        for need, entries in zip(plan.needs, found, strict=True):
            lacking = [entries[name] < 0 for name in plan.fields if name != "caption_encoder"]  # captions: no image
            images = need.images
            if lacking and images.members is None:  # byte ranges of containers: their index was just made from them
                check_files_exist(images.url, images.filenames, np.flatnonzero(np.logical_or.reduce(lacking)),
                                  need.root_field[0], images.storage_options, need.root_field[1])

    comm.on_every_rank(check, "checking that the images to cache are there")


def decode_workers(plan: CachePlan, device: torch.device, num_workers: int) -> int:
    """Loader workers to decode for a build: none when an image encoder runs on the CPU. Its threads take every
    core, and a worker decoding beside them slows each of its ops (threads wait for the one descheduled) by more
    than the decoding it takes over, a small share of a CPU encode (bench_pipeline: 1.0 s of 13 s saved)."""
    return 0 if plan.config.encoder is not None and device.type == "cpu" else num_workers


def check_encoder(plan: CachePlan, device: torch.device) -> None:
    """The encoder's output shapes on every bucket size of the run (see _check_encoder_shapes); its grid per bucket
    (width, height) kept in ``plan.grids``, which cached masks are made on."""
    if plan.config.encoder is not None:
        sizes = sorted({tuple(int(v) for v in s) for need in plan.needs for s in np.unique(need.sizes, axis=0)})
        shapes = _check_encoder_shapes(plan, device, sizes)
        plan.grids = {size: shape[-2:] for size, shape in shapes.items() if len(shape) >= 3}


def _drop_damaged(plan: CachePlan, comm: Comm, verify: bool) -> None:
    """Every rank checks every world-th listed shard (and that it can write); rank 0 drops the damaged ones."""
    store = plan.store

    def check_share() -> dict[str, dict[str, str]]:
        store.check_writable()
        damaged: dict[str, dict[str, str]] = defaultdict(dict)
        for name in plan.fields:
            for i, shard in enumerate(store.manifest(name)["shards"]):
                if i % comm.world == comm.rank and (problem := store.shard_problem(name, shard, verify)):
                    damaged[name][shard["name"]] = f"{problem} ({shard['samples']} samples)"
        return dict(damaged)

    merged: dict[str, dict[str, str]] = defaultdict(dict)
    for part in comm.on_every_rank(check_share, "checking the cache"):
        for name, shards in part.items():
            merged[name].update(shards)
    def drop() -> None:
        for name, shards in merged.items():
            for shard, problem in sorted(shards.items()):
                print(f"lit-dist cache: {name} shard {shard} is damaged: {problem}; its samples are rebuilt", flush=True)
            store.publish(name, drop=set(shards))

    comm.on_rank_zero(drop, "dropping damaged shards")


def _work(plan: CachePlan, found: list[dict], size: int) -> list[tuple[int, np.ndarray, dict]]:
    """Batches of samples that some field lacks: (dataset, rows of one bucket, {field: mask of rows it lacks})."""
    batches = []
    for d, need in enumerate(plan.needs):
        # Per row and field: (rows, entries per row), the caption field's entries being its tag orders.
        lacking = {name: need.entries(name, found[d][name] < 0) for name in plan.fields}
        todo = np.flatnonzero(np.logical_or.reduce([mask.any(1) for mask in lacking.values()]))
        if not len(todo):
            continue
        bucket = need.sizes[todo, 0].astype(np.int64) << 32 | need.sizes[todo, 1].astype(np.int64)
        for b in np.unique(bucket):
            rows = todo[bucket == b]
            for lo in range(0, len(rows), size):
                chunk = rows[lo : lo + size]
                # One flag per row and field; the caption field's per tag order.
                batches.append((d, chunk, {name: mask[chunk] if name == "caption_encoder" else mask[chunk, 0]
                                           for name, mask in lacking.items()}))
    return batches


def _share(work: list, rank: int, world: int) -> list:
    """This rank's batches: the largest first, each to the rank with the fewest samples so far (the same
    choice on every rank), so that no rank is left finishing alone; kept in their original order."""
    load = np.zeros(world, dtype=np.int64)
    owner = np.empty(len(work), dtype=np.int64)
    for j in sorted(range(len(work)), key=lambda j: -len(work[j][1])):
        owner[j] = int(np.argmin(load))
        load[owner[j]] += len(work[j][1])
    return [batch for batch, who in zip(work, owner, strict=True) if who == rank]


def _check_encoder_shapes(plan: CachePlan, device: torch.device, sizes: list[tuple[int, int]]) -> dict:
    """Run the encoder once per bucket size on zeros: outputs must be (B, ...) tensors whose dimensions other than
    the last two (spatial) agree between buckets, or no model could take them in one run. Returns each size's
    output shape per sample."""
    encoder = plan.encoder.to(device)
    shapes = {}
    with torch.inference_mode():
        for w, h in sizes:
            out = encoder(plan.normalised(torch.zeros(1, h, w, 3, dtype=torch.uint8, device=device)))
            if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[0] != 1:
                raise ConfigError(f"data.cache.encoder ({plan.config.encoder['class_path']}) returned "
                                  f"{type(out).__name__} {getattr(out, 'shape', '')} for a batch of 1: it must return "
                                  "a tensor (B, ...). Wrap it in a module whose forward returns one.")
            shapes[(w, h)] = tuple(out.shape[1:])
    fixed = {s[:-2] if len(s) >= 3 else s for s in shapes.values()}
    if len(fixed) > 1:
        listed = ", ".join(f"{w}x{h} -> {s}" for (w, h), s in shapes.items())
        raise ConfigError(f"data.cache.encoder ({plan.config.encoder['class_path']}) returns outputs whose non-spatial "
                          f"dimensions differ between buckets ({listed}); a model cannot take them. Use an encoder "
                          "with a fixed channel count, or pool its output to a fixed size.")
    if "mask" in plan.fields and any(len(s) < 3 for s in shapes.values()):
        raise ConfigError(f"data.cache.encoder ({plan.config.encoder['class_path']}) returns {next(iter(shapes.values()))}"
                          " per image, and the data has loss masks, which are cached on an encoder's spatial grid "
                          "(C, h, w): cache a VAE's latents, or remove mask_column / alpha_mask")
    return shapes


class _Decode(torch.utils.data.Dataset):
    """Loader-worker side of a build: the rows of batch j that need their image (pixels, encoder or mask lacking),
    decoded and resized to cover the bucket, with their masks where the mask is lacking; and which rows could not be
    decoded."""

    def __init__(self, plan: CachePlan, work: list):
        self.images = [need.images for need in plan.needs]
        self.sizes = [need.sizes for need in plan.needs]
        self.work = work

    def __len__(self) -> int:
        return len(self.work)

    def __getitem__(self, j: int):
        d, rows, lacking = self.work[j]
        w, h = (int(v) for v in self.sizes[d][rows[0]])
        masks = lacking.get("mask", np.zeros(len(rows), bool))
        wanted = lacking.get("pixels", False) | lacking.get("encoder", False) | masks  # captions need no image
        images, unreadable = [None] * len(rows), np.zeros(len(rows), dtype=bool)
        masked = [None] * len(rows)
        together = self.images[d].read_together(rows[wanted])  # a batch's neighbours in a tar shard: one read
        for i in np.flatnonzero(wanted):
            try:
                data = together.get(int(rows[i]))
                if masks[i]:
                    images[i], masked[i] = self.images[d].covering_and_mask(int(rows[i]), w, h, data)
                else:
                    images[i] = self.images[d].covering(int(rows[i]), w, h, data)
            except BadImage as exc:  # unreadable source: recorded as such, replaced at load like any bad image
                log.warning("lit-dist cache: cannot read %s (%s)", self.images[d]._path(int(rows[i])), exc)
                unreadable[i] = True
        return d, rows, lacking, (w, h), (images, masked), unreadable


class _Builder:
    """One rank's writers: entries in, shards out (atomic, then named in the rank's pending list)."""

    def __init__(self, plan: CachePlan, device: torch.device, outcome: dict, rank: int):
        self.plan, self.device, self.outcome, self.rank = plan, device, outcome, rank
        self.build = new_build_id()
        self.written: dict[str, list[dict]] = {name: [] for name in plan.fields}
        self.writers = {name: self.plan.writer(name) for name in plan.fields}
        self.caption_shape = None
        self.texts: list[tuple[int, int, str]] = []  # (sample, key, caption) not yet encoded
        self.encoded: OrderedDict[str, np.ndarray] = OrderedDict()  # caption -> its stored encoding, least recent first
        self.encoded_bytes = 0

    @functools.cached_property
    def encoder(self):
        """The image encoder on this rank's device, loaded and moved when the first image needs it (once)."""
        return self.plan.encoder.to(self.device)

    @functools.cached_property
    def captioner(self):
        """The caption encoder on this rank's device, loaded and moved when the first caption needs it (once)."""
        return self.plan.caption_encoder.to(self.device)

    def add(self, d: int, rows: np.ndarray, lacking: dict, size: tuple[int, int], decoded: tuple,
            unreadable) -> None:
        need, dtype = self.plan.needs[d], self.plan.config.encoder_dtype
        images, masks = decoded  # per row: its covering image and loss mask, where decoded
        made = {name: [None] * len(rows) for name in lacking}  # None: a source that cannot be decoded
        if "pixels" in lacking:
            made["pixels"] = images
        for i in np.flatnonzero(lacking.get("mask", [])):  # on the encoder's grid, from the crop the encoder sees
            if not unreadable[i]:
                grid = self.plan.grids[size]
                mask = masks[i] if masks[i] is not None else full(*images[i].shape[:2])
                made["mask"][i] = to_grid(centre_crop(mask, *size), *grid)
        todo = [i for i in np.flatnonzero(lacking.get("encoder", [])) if not unreadable[i]]
        if todo:
            crops = torch.from_numpy(np.stack([centre_crop(images[i], *size) for i in todo])).to(self.device)
            for i, array in zip(todo, _encode(self.encoder, crops, self.plan, dtype), strict=True):
                made["encoder"][i] = array
        for i, k in np.argwhere(lacking.get("caption_encoder", np.zeros((0, 1), bool))):  # CAPTION_BATCH at a time
            entry = k * len(need.samples) + rows[i]  # tag order k of row rows[i]
            text = ordered(need.captions[int(rows[i])].as_py() or "", int(k), need.keep_tokens)
            self.texts.append((int(need.caption_samples[entry]), int(need.keys["caption_encoder"][entry]), text))
        if len(self.texts) >= CAPTION_BATCH:
            self.encode_captions()
        for name, arrays in made.items():
            if name == "caption_encoder":
                continue
            for i in np.flatnonzero(lacking[name]):
                self.writers[name].add(int(need.samples[rows[i]]), int(need.keys[name][rows[i]]), arrays[i])
            if self.writers[name].nbytes >= self.plan.config.shard_size_mb * 1_000_000:
                self.flush(name)
        self.outcome["unreadable"] += int(unreadable.sum())
        self.outcome["samples"] += len(rows) - int(unreadable.sum())

    def encode_captions(self) -> None:
        """The captions gathered so far written, those not met before encoded in one call: a text encoder runs far
        faster on a few hundred captions at once than on one image batch's (they need no image, so they need not
        wait for one)."""
        if not self.texts:
            return
        writer = self.writers["caption_encoder"]
        new = list(dict.fromkeys(text for _, _, text in self.texts if text not in self.encoded))
        if new:
            for text, array in zip(new, self._captions(new), strict=True):
                self.encoded[text] = array = array.copy()  # not a view that keeps its whole batch alive
                self.encoded_bytes += array.nbytes
        for sample, key, text in self.texts:
            writer.add(sample, key, self.encoded[text])
            self.encoded.move_to_end(text)
        self.texts = []
        while self.encoded_bytes > CAPTION_MEMO_BYTES and len(self.encoded) > 1:
            self.encoded_bytes -= self.encoded.popitem(last=False)[1].nbytes
        if writer.nbytes >= self.plan.config.shard_size_mb * 1_000_000:
            self.flush("caption_encoder")

    def _captions(self, texts: list[str]) -> list[np.ndarray]:
        """Caption encoder outputs in the stored dtype, a dict of fields as one vector per caption (cache/captions.py);
        every batch must give the same shape per caption."""
        with torch.inference_mode():
            out = self.captioner(texts)
        if isinstance(out, dict):
            layout = self.plan.captions.layout if self.plan.captions is not None else None
            got = Layout.of(out) if all(isinstance(v, torch.Tensor) for v in out.values()) else None
            if layout is None:
                raise ConfigError(f"data.cache.caption_encoder ({self.plan.config.caption_encoder['class_path']}) "
                                  "returns a dict without saying what stands for no caption: give it a method "
                                  "empty_caption() returning the same dict for one caption")
            if got != layout or any(len(v) != len(texts) for v in out.values()):
                shapes = {k: tuple(getattr(v, "shape", ())) for k, v in out.items()}
                raise ConfigError(f"data.cache.caption_encoder returned {shapes} for {len(texts)} captions, and "
                                  f"{layout.describe()} per caption for the empty caption: every batch must give the "
                                  "same fields and shapes (pad to a fixed token count)")
            out = layout.flatten(out)
        if not isinstance(out, torch.Tensor) or out.ndim < 1 or out.shape[0] != len(texts):
            raise ConfigError(f"data.cache.caption_encoder ({self.plan.config.caption_encoder['class_path']}) returned "
                              f"{type(out).__name__} {getattr(out, 'shape', '')} for {len(texts)} captions: it must "
                              "return a tensor (B, ...)")
        if self.caption_shape is None:
            self.caption_shape = tuple(out.shape[1:])
        elif tuple(out.shape[1:]) != self.caption_shape:
            raise ConfigError(f"data.cache.caption_encoder returned {tuple(out.shape[1:])} per caption after "
                              f"{self.caption_shape}: pad or pool to one shape (e.g. a fixed token count)")
        return _stored(out, self.plan.config.encoder_dtype)

    def flush(self, name: str) -> None:
        writer = self.writers[name]
        if not len(writer):
            return
        samples, raw = writer.samples, writer.raw_bytes
        data, index = writer.finish()
        store = self.plan.store
        self.written[name].append(store.write_shard(name, self.plan.fingerprints[name], data, index, raw, samples,
                                                    len(writer), writer.encoding))
        store.record_pending(name, self.build, self.rank, self.written[name])
        self.outcome["bytes"] += len(data)
        self.outcome["raw_bytes"] += raw
        self.outcome["shards"] += 1
        self.writers[name] = self.plan.writer(name)


def _run(plan: CachePlan, mine: list, device: torch.device, num_workers: int, outcome: dict, rank: int,
         progress: bool, preempted: "_PreemptionFlag | None" = None, worker_start: Start = "auto") -> None:
    from lit_dist.runtime.counter import counter

    builder = _Builder(plan, device, outcome, rank)
    # Its own generator: a loader started from the global RNG would shift every random draw of the training
    # that follows (mode build), and a run would differ from one that found the cache complete.
    loader = torch.utils.data.DataLoader(_Decode(plan, mine), batch_size=None, num_workers=num_workers,
                                         collate_fn=_as_is, generator=torch.Generator().manual_seed(0),
                                         worker_init_fn=ignore_stop_signals,
                                         multiprocessing_context=context(worker_start) if num_workers > 0 else None)
    total = sum(len(rows) for _, rows, _ in mine)
    with counter(total, f"lit-dist cache (rank {rank})", "img", show=progress and rank == 0) as bar:
        for d, rows, lacking, size, decoded, unreadable in loader:
            builder.add(d, rows, lacking, size, decoded, unreadable)
            bar.update(len(rows))
            if preempted is not None and preempted.received:
                break
    if "caption_encoder" in plan.fields:
        builder.encode_captions()
    for name in plan.fields:
        builder.flush(name)


def _as_is(item):
    return item  # the default collate would turn the arrays into tensors


def _encode(encoder, crops: torch.Tensor, plan: CachePlan, dtype: str) -> list[np.ndarray]:
    """Encoder outputs of centre crops (B, H, W, 3) uint8 on the encoder's device, in the stored dtype."""
    with torch.inference_mode():
        return _stored(encoder(plan.normalised(crops)), dtype)


def _stored(out: torch.Tensor, dtype: str) -> list[np.ndarray]:
    """One array per sample of ``out`` (B, ...) in the stored dtype (bf16 as raw 16-bit words: numpy has no bf16)."""
    target = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    out = out.to(target).cpu().contiguous()
    if dtype == "bf16":
        return list(out.view(torch.int16).numpy().view(np.uint16))
    return list(out.numpy())
