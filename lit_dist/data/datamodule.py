"""``BucketDataModule``: aspect-ratio-bucketed images from a parquet table, a folder scan or a Hugging Face dataset.

Example (YAML)::

    data:
      metadata: s3://my-bucket/meta/          # a parquet file, folder of files or glob
      storage_options: {endpoint_url: http://127.0.0.1:9000}
      batch_size_per_device: 32
      resolution: 512

    data:
      scan_root: /datasets/photos              # no table: index the folder (headers only, cached)
      labels_from_folders: true

    data:
      hf_dataset: /datasets/pokemon            # a Hugging Face dataset's save_to_disk folder (indexed once)
      caption_column: text

Batches leave the loader workers as uint8 and are converted and normalised on
the device (``on_after_batch_transfer``): four times less to copy, and the
arithmetic runs where it is cheap.
"""

import os
import warnings

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_dist.cache.attach import build_for, open_views, plan_for
from lit_dist.cache.captions import empty_key
from lit_dist.cache.config import CacheConfig
from lit_dist.data.health import BadSamples
from lit_dist.data.sources import DatasetSource
from lit_dist.errors import ConfigError, DataError
from lit_dist.reading.workers import START_METHODS, QuietWorkerInit, Start, context, start_early
from lit_dist.runtime import compat
from lit_dist.runtime.control import RunControl
from lit_dist.runtime.processes import end_helpers


class BucketDataModule(LightningDataModule):
    """Images grouped into aspect-ratio buckets, with a sampler that gives every rank equal work."""

    def __init__(
        self,
        metadata: str | None = None,
        scan_root: str | None = None,
        root: str | None = None,
        datasets: list[DatasetSource] | None = None,
        batch_size_per_device: int = 32,
        resolution: int = 256,
        alignment: int = 8,
        max_aspect: float = 2.0,
        random_crop: bool = True,
        size_conditions: bool = False,
        repeats: int = 1,
        allow_oversubscription: bool = False,
        val_fraction: float = 0.05,
        extra_columns: list[str] | None = None,
        strict: bool = False,
        labels_from_folders: bool = False,
        index_cache: str | None = None,
        preserve_cache: bool = False,
        hf_dataset: str | None = None,
        image_column: str = "image",
        caption_column: str | None = None,
        label_column: str | None = None,
        webdataset: str | list[str] | None = None,
        caption_dropout: float | None = None,
        tag_orders: int = 1,
        keep_tokens: int = 0,
        mask_column: str | None = None,
        alpha_mask: bool = False,
        num_workers: int = 2,
        worker_start: Start = "auto",
        seed: int = 0,
        shuffle_block: int = 1,
        mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        max_image_pixels: int = 178_956_970,
        max_bad_fraction: float = 0.01,
        storage_options: dict | None = None,
        outage_deadline_s: float = 180.0,
        create_demo_if_missing: bool = False,
        demo_num_images: int = 3000,
        cache: CacheConfig = CacheConfig(),
        node_index_dir: str | None = "/dev/shm",
    ):
        """Configure the data.

        Args:
            metadata: Parquet table: a file, a folder of .parquet files or a glob, local or fsspec URL (s3://...).
            scan_root: Instead of metadata: a folder of images (local or URL) to index by reading image headers.
            root: Folder the filenames are relative to; default: the folder of metadata, or scan_root.
            datasets: Instead of metadata/scan_root: several datasets mixed by weight (each with its own root, repeats).
            batch_size_per_device: Samples per batch on each device; the global batch is this x world size.
            resolution: Bucket area is about resolution**2 pixels (e.g. 256 gives 256x256, 320x192, ...).
            alignment: Bucket sides are multiples of this many pixels.
            max_aspect: Largest bucket aspect ratio, long side / short side.
            random_crop: Crop training images at a random offset (from seed, epoch, index) instead of the centre.
            size_conditions: Give the model each image's original size and crop with its caption (SDXL's time_ids; pipeline.path sets it for SDXL).
            repeats: Times each training sample is seen per epoch.
            allow_oversubscription: Repeat buckets smaller than one global batch as often as needed instead of failing.
            val_fraction: Share of rows used for validation when the table has no split column.
            extra_columns: Table columns passed through to batches; default: caption if present.
            strict: Fail on any bad row (bad path, size or duplicate) instead of skipping and reporting it.
            labels_from_folders: With scan_root: the first folder level of each image is its label.
            index_cache: With scan_root or hf_dataset: where the index is kept; default ~/.cache/lit-dist/.
            preserve_cache: With scan_root: use the cached index as it is, without rescanning the folder.
            hf_dataset: Instead of metadata: a Hugging Face dataset: a save_to_disk folder (local or URL), parquet files with an image column, or a hub id.
            image_column: With hf_dataset: the column of the images (datasets.Image or bytes).
            caption_column: The column of the captions; default caption (with hf_dataset: caption, text or prompt, whichever it has).
            label_column: With hf_dataset: the column of the labels; default label if present.
            webdataset: Instead of metadata: WebDataset tar shards, a brace pattern or a list (local or URLs).
            caption_dropout: Share of the training captions replaced by the empty caption; default: model.objective.condition_dropout.
            tag_orders: Orders of each caption's comma-separated tags that training draws from: as written and tag_orders - 1 shuffles, each cached once.
            keep_tokens: With tag_orders > 1: this many leading tags stay in front, in their order.
            mask_column: With metadata: the column of each image's loss mask, a path relative to root (white counts, black is ignored; empty: all counts).
            alpha_mask: Each image's alpha channel is its loss mask (opaque counts; an image without alpha counts everywhere).
            num_workers: Loader worker processes per device; 0 loads in the training process.
            worker_start: How loader workers start: auto is fork, or forkserver on Pythons whose fork can hang (docs/data.md).
            seed: Seed of the data order and random crops; the order depends only on (seed, epoch).
            shuffle_block: Shuffle each bucket in runs of this many neighbours in the table (tar shards, Arrow files), each run read with one request; 1: sample by sample.
            mean: Per-channel mean subtracted after scaling pixels to [0, 1].
            std: Per-channel standard deviation divided by after subtracting the mean.
            max_image_pixels: Images with more pixels are refused as decompression bombs (Pillow's guard).
            max_bad_fraction: Stop training when more than this share of the images read could not be decoded.
            storage_options: fsspec options for remote data (e.g. endpoint_url); credentials come from env vars.
            outage_deadline_s: Seconds to wait out an object store that does not answer (with backoff) before stopping with exit 17; keep it below watchdog.min_timeout_s.
            create_demo_if_missing: Generate the demo dataset if missing, only at its place data/shapes/metadata.parquet.
            demo_num_images: Number of images the demo dataset gets when generated.
            cache: Preprocessed cache of resized pixels and encoder outputs, read instead of decoding images.
            node_index_dir: Node-local folder (shared memory) through which one rank per node shares the metadata index with the node's other ranks; null: every rank reads the table.
        """
        super().__init__()
        problems = []
        if datasets:
            if any(v is not None for v in (metadata, scan_root, hf_dataset, webdataset)):
                problems.append("data.datasets is set together with data.metadata, data.scan_root, data.hf_dataset "
                                "or data.webdataset: use one form")
            sources = list(datasets)
        else:
            sources = [DatasetSource(metadata, scan_root, root, 1.0, repeats, labels_from_folders, index_cache,
                                     hf_dataset, image_column, caption_column, label_column, webdataset,
                                     caption_dropout, tag_orders, keep_tokens, mask_column, alpha_mask)]
        for i, source in enumerate(sources):
            problems += source.problems(f"data.datasets[{i}]" if datasets else "data")
        if batch_size_per_device < 1:
            problems.append(f"data.batch_size_per_device = {batch_size_per_device}: must be >= 1")
        if not 0 <= max_bad_fraction <= 1:
            problems.append(f"data.max_bad_fraction = {max_bad_fraction}: must be in [0, 1]")
        if not 0 <= val_fraction < 1:
            problems.append(f"data.val_fraction = {val_fraction}: must be in [0, 1)")
        if shuffle_block < 1:
            problems.append(f"data.shuffle_block = {shuffle_block}: must be >= 1 (1 shuffles sample by sample)")
        if num_workers < 0:
            problems.append(f"data.num_workers = {num_workers}: must be >= 0 (0 loads in the training process)")
        if worker_start not in START_METHODS:
            problems.append(f"data.worker_start = {worker_start!r}: must be one of {', '.join(START_METHODS)}")
        if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
            problems.append(f"data.mean = {list(mean)}, data.std = {list(std)}: need 3 values each, std > 0")
        if cache is not None:  # None: no cache, as in code that builds the module without the CLI
            problems += cache.problems()
        masked = [prefix for prefix, source in zip(self._source_prefixes(bool(datasets), len(sources)), sources,
                                                   strict=True) if source.masked]
        if masked and cache is not None and cache.enabled and cache.pixels:
            problems.append(f"{masked[0]} has loss masks, and data.cache.pixels is true: masks are cached beside "
                            "encoder outputs (latents), not pixels; set data.cache.pixels: false (images and masks are "
                            "then decoded each step)")
        if masked and cache is not None and cache.enabled and cache.mode == "ondemand" and cache.encoder is not None:
            problems.append(f"{masked[0]} has loss masks, and data.cache.mode is ondemand, which makes no masks: use "
                            "data.cache.mode build (or read after `lit-dist cache`)")
        if size_conditions and (cache is None or cache.caption_encoder is None):
            problems.append("data.size_conditions = true gives the size conditions with a pipeline's cached captions, "
                            "and this run caches none: set pipeline.path (SDXL), or remove data.size_conditions")
        if create_demo_if_missing and metadata is not None and "://" in metadata:
            problems.append(f"data.create_demo_if_missing needs a local data.metadata path, not {metadata!r}")
        if outage_deadline_s <= 0:
            problems.append(f"data.outage_deadline_s = {outage_deadline_s}: must be positive (seconds)")
        ConfigError.collect(problems)
        from lit_dist.data.buckets import make_buckets

        self.bucket_sizes = make_buckets(resolution, alignment, max_aspect)  # validates those three
        self.sources = sources
        self._prefixes = self._source_prefixes(bool(datasets), len(sources))
        self.metadata = metadata
        self.batch_size_per_device = batch_size_per_device
        self.random_crop = random_crop
        self.shuffle_block = shuffle_block
        self.size_conditions = size_conditions
        self.allow_oversubscription = allow_oversubscription
        self.val_fraction = val_fraction
        self.extra_columns = extra_columns
        self.strict = strict
        self.preserve_cache = preserve_cache
        self.num_workers = num_workers
        self.worker_start = worker_start
        if num_workers > 0:
            start_early(worker_start)
        self.seed = seed
        self.max_image_pixels = max_image_pixels
        self.bad_samples = BadSamples(max_bad_fraction)
        self.storage_options = storage_options
        self.outage_deadline_s = outage_deadline_s
        self.node_index_dir = node_index_dir
        self.create_demo_if_missing = create_demo_if_missing
        self.demo_num_images = demo_num_images
        self.cache = cache if cache is not None and cache.enabled else None
        self.resolution, self.alignment, self.max_aspect = resolution, alignment, max_aspect
        self.normalisation = (tuple(mean), tuple(std))
        self._cache_views: list[dict] | None = None  # per dataset {batch key: FieldView}, after setup
        self._filler = None  # mode ondemand, while entries are missing: takes the new ones from batches
        self._captions = None  # cache.captions.Captions of a pipeline's caption cache: fields' layout, empty caption
        self._empty = None  # (device, the empty caption's fields on it)
        self._fill_keys: list | None = None
        self.mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std).view(1, 3, 1, 1) * 255
        self.classes: list[str] | None = None
        self._splits: dict = {}
        self._resume: dict | None = None
        self._train_sampler = None  # the fit's sampler: it owns the training position

    @staticmethod
    def _source_prefixes(listed: bool, count: int) -> list[str]:
        """Where each dataset is configured, for messages: data.datasets[i], or data for the single one."""
        return [f"data.datasets[{i}]" if listed else "data" for i in range(count)]

    # -- reading ----------------------------------------------------------------------------

    def prepare_data(self) -> None:
        # Lightning runs this on local rank 0 of each node while the other ranks wait.
        if self.create_demo_if_missing and self.metadata is not None and not os.path.exists(self.metadata):
            from lit_dist.data.demo.shapes import create_shapes_dataset, is_demo_place

            # Only at the demo's own place: any other missing table is the data error read() raises on every rank.
            if is_demo_place(self.metadata):
                rank_zero_info(f"lit-dist: demo dataset not found at {self.metadata}; generating it (once)")
                create_shapes_dataset(self.metadata, num_images=self.demo_num_images, seed=self.seed)
        from lit_dist.runtime.distributed import Comm

        if Comm.current().world == 1:  # with several ranks, setup() scans: every rank reads a share of the headers
            self.index_folders()

    def index_folders(self) -> None:
        """Index every ``scan_root`` dataset into its cached table (headers of new or changed files only), and every
        ``hf_dataset`` and ``webdataset`` whose files changed since its index was made.

        A collective when a process group of several ranks exists (every rank must call it): the
        header reads are split among the ranks, rank 0 writes the table, every rank then reads it.
        """
        from lit_dist.data import hf_dataset, webdataset
        from lit_dist.data.discovery import load_or_scan
        from lit_dist.runtime.distributed import Comm

        comm = Comm.current()
        for source in self.sources:
            if source.scan_root is not None:
                load_or_scan(source.scan_root, source.table_path, self.storage_options, source.labels_from_folders,
                             self.preserve_cache, comm=comm)
            elif source.hf_dataset is not None:
                columns = hf_dataset.Columns(source.image_column, source.caption_column, source.label_column)
                hf_dataset.load_or_index(source.hf_dataset, columns, source.table_path, self.storage_options, comm)
            elif source.webdataset is not None:
                webdataset.load_or_index(source.webdataset, source.table_path, self.storage_options, comm)

    def read(self, shared: bool = False) -> list:
        """Per dataset: its cleaned metadata (bad rows reported), each row's bucket and split (0/1/2).
        ``shared``: read once per node and mapped by its other ranks (``lit_dist.data.node_index``; a collective)."""
        from lit_dist.data.node_index import shared_index
        from lit_dist.runtime.distributed import Comm

        parts, self.classes = shared_index(self._read_tables, self.node_index_dir if shared else None, Comm.current())
        return parts

    def _read_tables(self) -> tuple[list, list[str] | None]:
        from lit_dist.data.metadata import read_metadata
        from lit_dist.data.sources import merge_labels

        parts = []
        for source in self.sources:
            # The index of a scan or a Hugging Face dataset is on local or home storage, not behind storage_options.
            options = self.storage_options if not source.indexed else None
            # A Hugging Face dataset's index names its captions `caption` whatever its column (chosen at indexing).
            captions = source.caption_column if source.hf_dataset is None else None
            meta = read_metadata(source.table_path, options, extra_columns=self.extra_columns, strict=self.strict,
                                 val_fraction=self.val_fraction, identity=self.cache is not None,
                                 caption_column=captions, mask_column=source.mask_column)
            if meta.bad.total:
                rank_zero_warn(f"lit-dist: skipped {meta.bad.total} bad rows of {source.table_path}: {meta.bad.summary()}")
            parts.append((meta, meta.bucket_ids(self.bucket_sizes), meta.splits))
        return parts, merge_labels([meta for meta, _, _ in parts])

    def connect(self, control: RunControl) -> None:
        """Take part in the run control (called by it at setup, after this module's setup): the bad-sample
        count is a shared fact; cache entries made on demand are published at its epoch boundaries."""
        self.bad_samples.connect(control)
        if self._filler is not None:
            self._filler.connect(control)

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if self._splits:
            return
        from lit_dist.runtime.distributed import Comm

        if Comm.current().world > 1:  # every rank is here (prepare_data runs on one per node): split the scan
            self.index_folders()
        parts = self.read(shared=True)
        if self.cache is None:  # images are decoded: before anything else, are they where the root says?
            self.check_roots(parts)
        else:  # the cache checks the images it will decode itself (none in mode read)
            device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
            opened = open_views(self, parts, device)
            self._cache_views, self._filler, self._fill_keys = opened.views, opened.filler, opened.fill_keys
            self._captions = opened.captions
        if self.size_conditions and self._captions is None:  # a caption encoder that is not a pipeline's
            raise ConfigError("data.size_conditions = true gives the size conditions with a pipeline's cached captions, "
                              "and this run's are one tensor: set pipeline.path (SDXL), or remove data.size_conditions")
        views = self._cache_views or [None] * len(parts)
        fills = self._fill_keys or [None] * len(parts)
        # (N, 2) original (width, height) by table position, once per dataset: the splits share it as their columns.
        sizes = [np.stack([meta.sizes.column(name).to_numpy().astype(np.int32) for name in ("width", "height")], 1)
                 if self.size_conditions else None for meta, _, _ in parts]
        for code, split in enumerate(("train", "val", "test", "predict")):
            chosen = [np.flatnonzero(splits == code) if code < 3 else np.arange(len(meta)) for meta, _, splits in parts]
            datasets = [self._dataset(source, meta, rows, buckets[rows], self.random_crop and split == "train", view, fill,
                                      size, source.caption_rule if split == "train" else None)
                        for source, (meta, buckets, _), rows, view, fill, size in zip(self.sources, parts, chosen, views,
                                                                                     fills, sizes, strict=True)]
            self._splits[split] = self._combine(datasets)
        if len(self._splits["train"]) == 0 and stage == "fit":
            raise DataError(f"{', '.join(s.table_path for s in self.sources)}: no training rows "
                            "(check the split column or data.val_fraction)")
        if len(self._splits["test"]) == 0:  # tables without a test split evaluate `test` on the validation rows
            self._splits["test"] = self._splits["val"]

    def pick(self, key: str, n: int, seed: int, split: str = "val") -> list:
        """``n`` values of ``key`` (label, or a passed-through column such as caption) from ``split``'s rows (the
        training rows when it has none), chosen by ``seed``: the same on every rank, and after a resume of the
        same table. Fewer when the split has fewer rows; [] when no row has ``key``."""
        dataset = self._splits.get(split)
        if dataset is None or len(dataset) == 0:
            dataset = self._splits.get("train")
        parts = getattr(dataset, "parts", [dataset]) if dataset is not None else []
        values = []
        for part in parts:  # every dataset of a mix, in turn: few positions per part, not the whole column
            column = part.labels if key == "label" else part.extra.get(key)
            if column is None:
                continue
            positions = part.positions
            chosen = np.random.default_rng(seed).choice(len(positions), size=min(n, len(positions)), replace=False)
            taken = positions[np.sort(chosen)]
            values += [int(v) for v in column[taken]] if key == "label" else column.take(taken).to_pylist()
        if len(values) > n:
            values = [values[i] for i in np.sort(np.random.default_rng(seed).choice(len(values), n, replace=False))]
        return values

    def root_field(self, i: int) -> tuple[str, str]:
        """The config field that gives dataset ``i``'s image root, and how it is set (for messages)."""
        source, prefix = self.sources[i], self._prefixes[i]
        if source.root is not None:
            return f"{prefix}.root", ""
        if source.scan_root is not None:
            return f"{prefix}.scan_root", ""
        if source.hf_dataset is not None:
            return f"{prefix}.hf_dataset", ""
        if source.webdataset is not None:
            return f"{prefix}.webdataset", ""
        return f"{prefix}.root", f" (unset: the folder of {prefix}.metadata)"

    def check_roots(self, parts: list) -> None:
        """Every rank looks up a sample of each dataset's files (a collective): a wrong root stops the run here,
        with a data error naming it (and where the files are, when a folder next to it holds them)."""
        from lit_dist.reading.presence import check_files_exist
        from lit_dist.runtime.distributed import Comm

        def check() -> None:
            for i, (source, (meta, _, _)) in enumerate(zip(self.sources, parts, strict=True)):
                if source.containers:  # its index was made from (or checked against) its files just now
                    continue
                field, how = self.root_field(i)
                check_files_exist(source.image_root, meta.filenames, np.arange(len(meta)), field, self.storage_options,
                                  how)

        Comm.current().on_every_rank(check, "checking that the dataset's files are there")

    def _combine(self, datasets: list):
        if len(datasets) == 1:
            return datasets[0]
        from lit_dist.data.sources import MixedDataset

        k = len(self.bucket_sizes)
        groups = np.concatenate([d.bucket_ids.astype(np.int32) + i * k for i, d in enumerate(datasets)])
        return MixedDataset(datasets, groups)

    def _dataset(self, source, meta, rows: np.ndarray, bucket_ids: np.ndarray, random_crop: bool, cache: dict | None = None,
                 fill=None, sizes: np.ndarray | None = None, captions=None):
        from lit_dist.data.dataset import BucketImageDataset
        from lit_dist.reading.masks import Masks

        # An image encoder's outputs cached (without pixels): batches carry them instead of images, and no image is
        # opened (a cache of captions alone leaves the images to be decoded).
        load_images = cache is None or "pixels" in cache or self.cache.encoder_key not in cache
        return BucketImageDataset(
            root=source.image_root,
            filenames=meta.filenames,
            bucket_sizes=self.bucket_sizes,
            bucket_ids=bucket_ids,
            labels=meta.labels,
            rows=rows if meta.rows is None else meta.rows[rows],
            extra=meta.extra,
            random_crop=random_crop,
            seed=self.seed,
            storage_options=self.storage_options,
            outage_deadline_s=self.outage_deadline_s,
            max_image_pixels=self.max_image_pixels,
            positions=rows,
            cache=cache,
            load_images=load_images,
            fill=fill,
            sizes=sizes,
            members=meta.members,
            captions=captions,
            masks=Masks(meta.masks, source.alpha_mask) if source.masked else None,
        )

    # -- cache ------------------------------------------------------------------------------

    def cache_plan(self, parts: list):
        """The CachePlan of this data: every row of every dataset, keyed for each cached field."""
        return plan_for(self, parts)

    def build_cache(self, device: torch.device, verify: bool = False, parts: list | None = None):
        """Build what the cache lacks on every rank of the run (a collective: every rank must call it)."""
        return build_for(self, device, verify, parts)

    def groups(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per group (dataset x bucket): its (width, height), its dataset, and its dataset's repeats."""
        k, n = len(self.bucket_sizes), len(self.sources)
        sizes = np.tile(self.bucket_sizes, (n, 1))
        source = np.repeat(np.arange(n), k)
        repeats = np.repeat([s.repeats for s in self.sources], k)
        return sizes, source, repeats

    # -- batches ----------------------------------------------------------------------------

    def world(self) -> tuple[int, int]:
        """(world size, global rank) of the attached trainer, or (1, 0)."""
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def train_sampler(self, world_size: int, rank: int):
        """The training sampler for a world of ``world_size``; raises DataError when buckets are too small."""
        from lit_dist.data.sampler import BucketBatchSampler

        dataset = self._splits["train"]
        per_group, source, rows, problems = self.plan_train(dataset.bucket_ids, world_size)
        if problems:
            raise DataError("; ".join(problems))
        raised = [r for r in rows if r["repeats"] > self.sources[r["dataset"]].repeats]
        if raised:
            rank_zero_warn("lit-dist: allow_oversubscription repeats small buckets: "
                           + ", ".join(f"{r['bucket']} x{r['repeats']} ({r['samples']} samples)" for r in raised))
        remote = [s.image_root for s in self.sources if s.containers and "://" in s.image_root]
        if remote and self.shuffle_block == 1 and self._cache_views is None:  # every image decoded, every epoch
            rank_zero_info(f"lit-dist: the images under {remote[0]} are read with one request each; "
                           f"data.shuffle_block: {self.batch_size_per_device} reads a batch's neighbours in a file with "
                           "one (docs/data.md, Buckets and batches)")
        weights = np.array([s.weight for s in self.sources]) if len(self.sources) > 1 else None
        return BucketBatchSampler(dataset.bucket_ids, self.batch_size_per_device, world_size, rank, self.seed,
                                  shuffle=True, repeats=per_group, group_source=source, source_weights=weights,
                                  shuffle_block=self.shuffle_block)

    def plan_train(self, group_ids: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray, list[dict], list[str]]:
        """Repeats per group (dataset x bucket), each group's dataset, a report row per group, and problems."""
        from lit_dist.data.sampler import plan_buckets

        sizes, source, repeats = self.groups()
        global_batch = self.batch_size_per_device * world_size
        per_group, rows, problems = plan_buckets(group_ids, sizes, global_batch, repeats, self.allow_oversubscription)
        for row in rows:
            row["dataset"] = int(source[row["group"]])
        return per_group, source, rows, problems

    def _loader(self, split: str, sampler):
        dataset = self._splits[split]
        decodes = any(part.load_images and "pixels" not in part.cache for part in getattr(dataset, "parts", [dataset]))
        if self.cache is not None and self.cache.threads and self._filler is None and not decodes and split != "predict":
            # Every entry is in the cache (modes read and build): threads read it, see data/threads.py. Images still
            # to decode (a cache of captions alone) stay in worker processes, as without a cache.
            # Predicting keeps the DataLoader, which Lightning itself splits among ranks.
            from lit_dist.data.threads import ThreadLoader

            return ThreadLoader(self._splits[split], sampler, self.num_workers)
        return _SeededLoader(
            self.seed,
            self._splits[split],
            sampler=sampler,
            batch_size=None,  # the dataset returns whole batches
            num_workers=self.num_workers,
            # Filling the cache, workers restart each epoch to carry the lookups of entries made in the last one.
            persistent_workers=self.num_workers > 0 and self._filler is None,
            pin_memory=torch.cuda.is_available(),
            multiprocessing_context=context(self.worker_start) if self.num_workers > 0 else None,
        )

    def _eval_loader(self, split: str, distributed: bool = True):
        from lit_dist.data.sampler import BucketBatchSampler

        world_size, rank = self.world() if distributed else (1, 0)
        dataset = self._splits[split]
        return self._loader(split, BucketBatchSampler(dataset.bucket_ids, self.batch_size_per_device, world_size, rank,
                                                      self.seed, shuffle=False))

    def train_dataloader(self):
        if self._filler is not None and not self._filler.connected:
            raise ConfigError("data.cache.mode ondemand publishes new entries at the run control's epoch boundaries: "
                              "add lit_dist.runtime.control.RunControl() to the trainer's callbacks (lit-dist fit adds it)")
        sampler = self.train_sampler(*self.world())
        self._train_sampler = sampler
        if self._resume:
            # Lightning takes the first batch of a run from this loader before it sets the epoch.
            state, self._resume = self._resume, None
            start, message = sampler.resume_from(state)
            if message:
                rank_zero_warn(message)
            if start is not None:
                compat.shift_batches_done(self.trainer, start - compat.batches_done(self.trainer))
        return self._loader("train", sampler)

    def probe_loader(self, world_size: int, rank: int):
        """A training loader like the first epoch's (workers, cache, batches) for measuring it (preflight); the
        resume position and the loader Lightning trains from are left alone. After ``setup("fit")``."""
        return self._loader("train", self.train_sampler(world_size, rank))

    def val_dataloader(self):
        return self._eval_loader("val")

    def test_dataloader(self):
        return self._eval_loader("test")

    def predict_dataloader(self):
        # Every row of the table. Lightning splits the batches of one sampler among ranks itself when predicting.
        return self._eval_loader("predict", distributed=False)

    def on_exception(self, exception: BaseException) -> None:
        # The run ends (Lightning calls this before its teardown): the loader workers have nothing left to do, and
        # one blocked in a read would hold the teardown's join for 5 s, then the exit (reading/workers.py).
        end_helpers()

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        # Counted while the batch is still on the host: reading a count from the GPU would sync every step.
        self.bad_samples.count(batch)
        if self._filler is not None:
            self._filler.take(batch)
        return batch

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        if "_encode" in batch:
            self._filler.encode(batch, self.cache.encoder_key, batch["_encode"]["input"].device)
        for key in (self.cache.encoder_key, self.cache.caption_key) if self.cache is not None else ():
            if key in batch:
                # Stored and sent in data.cache.encoder_dtype (half the bytes for bf16); the model gets float32,
                # which autocast lowers again under mixed precision.
                batch[key] = batch[key].float()
        if self._captions is not None and self.cache.caption_key in batch:
            # A pipeline's caption fields, one vector per caption in the cache: the dict its denoiser takes, and
            # beside it the empty caption that the objective's condition dropout puts in a dropped caption's place.
            key = self.cache.caption_key
            batch[key] = self._captions.layout.unflatten(batch[key])
            device = batch[key][self._captions.layout.fields[0][0]].device
            if self._empty is None or self._empty[0] != device:  # moved once, not every batch
                self._empty = device, {k: v.to(device) for k, v in self._captions.empty.items()}
            batch[empty_key(key)] = dict(self._empty[1])
            if "time_ids" in batch:  # the size conditions go with the caption (never dropped with it)
                batch[key]["time_ids"] = batch.pop("time_ids")
        if "image" in batch:  # else only encoder outputs cached: nothing to normalise
            image = batch["image"].permute(0, 3, 1, 2).float()  # (B, H, W, C) uint8 -> (B, C, H, W) float, 0..255
            if self.mean.device != image.device:  # moved once, not every batch
                self.mean, self.std = self.mean.to(image.device), self.std.to(image.device)
            batch["image"] = (image - self.mean) / self.std
        # Lightning's precision plugin casts a batch's floating tensors to the weights' dtype where the weights are
        # not float32 (DeepSpeed's bf16, "bf16-true"), but before this hook, when images were still uint8:
        # DeepSpeed's bf16 weights then met float32 images (GPU tier). Cast what this hook made float, as it would.
        trainer = self.trainer
        return trainer.precision_plugin.convert_input(batch) if trainer is not None else batch

    # -- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The training position, saved in checkpoints: epoch, batches done in it, the global batch size,
        and the parts of the epoch trained with other global batch sizes (after such a resume)."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":  # also during fit's validation runs
            return {}
        # `processed`, not `completed`: a checkpoint written in on_train_batch_end runs before Lightning
        # counts that batch as completed, and that batch must not be trained on twice.
        # The global batch too: a run resumed with another one re-plans the rest of the epoch.
        if compat.is_last_batch(trainer):  # the epoch is done: resume at the start of the next one
            return {"epoch": compat.next_epoch(trainer), "batches_done": 0,
                    "global_batch_size": self.batch_size_per_device * trainer.world_size}
        sampler = self._train_sampler or self.train_sampler(*self.world())
        return sampler.position(trainer.current_epoch, compat.batches_done(trainer))

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position without replaying the loader: the sampler skips what was done."""
        self._resume = dict(state) if state else None
        if self._resume:
            # Lightning warns that a mid-epoch resume repeats data unless the DataLoader is stateful;
            # here the sampler restarts at the saved position, so nothing repeats.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


class _SeededLoader(torch.utils.data.DataLoader):
    """A DataLoader that draws its worker seeds from (seed, epoch), not from the global RNG.

    A plain DataLoader takes one number from torch's global generator each time it starts an
    epoch. A run resumed mid-epoch starts its loader at another point of that stream than the
    uninterrupted run did, which would shift every random draw after it (dropout, noise).
    """

    def __init__(self, seed: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seed = seed

    def __iter__(self):
        epoch = getattr(self.sampler, "epoch", 0)
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        if self.num_workers > 0 and not isinstance(self.worker_init_fn, QuietWorkerInit):
            # Wrapped here, not at construction: Lightning adds its worker seeding only where none is set.
            self.worker_init_fn = QuietWorkerInit(self.worker_init_fn)
        return super().__iter__()
