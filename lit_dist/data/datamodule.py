"""``BucketDataModule``: aspect-ratio-bucketed images from a parquet metadata table.

Example (YAML)::

    data:
      metadata: data/shapes/metadata.parquet
      batch_size_per_device: 32
      resolution: 32

Batches leave the loader workers as uint8 and are converted and normalised on
the device (``on_after_batch_transfer``): four times less to copy, and the
arithmetic runs where it is cheap.
"""

import logging
import os

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_dist.errors import ConfigError, DataError

log = logging.getLogger(__name__)


class BucketDataModule(LightningDataModule):
    """Images grouped into aspect-ratio buckets, with a sampler that gives every rank equal work."""

    def __init__(
        self,
        metadata: str,
        root: str | None = None,
        batch_size_per_device: int = 32,
        resolution: int = 256,
        alignment: int = 8,
        max_aspect: float = 2.0,
        random_crop: bool = True,
        val_fraction: float = 0.05,
        num_workers: int = 2,
        seed: int = 0,
        mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        storage_options: dict | None = None,
        create_demo_if_missing: bool = False,
        demo_num_images: int = 3000,
    ):
        """Configure the data.

        Args:
            metadata: Parquet table (local path or fsspec URL) with columns filename, width, height [, label, caption, split].
            root: Folder the filenames are relative to; default: the folder of ``metadata``.
            batch_size_per_device: Samples per batch on each device; the global batch is this x world size.
            resolution: Bucket area is about resolution**2 pixels (e.g. 256 gives 256x256, 320x192, ...).
            alignment: Bucket sides are multiples of this many pixels.
            max_aspect: Largest bucket aspect ratio, long side / short side.
            random_crop: Crop training images at a random offset (from seed, epoch, index) instead of the centre.
            val_fraction: Share of rows used for validation when the table has no ``split`` column.
            num_workers: Loader worker processes per device; 0 loads in the training process.
            seed: Seed of the data order and random crops; the order depends only on (seed, epoch).
            mean: Per-channel mean subtracted after scaling pixels to [0, 1].
            std: Per-channel standard deviation divided by after subtracting the mean.
            storage_options: fsspec options for remote metadata and images (e.g. S3 endpoint); no secrets here, use env vars.
            create_demo_if_missing: Generate the demo shapes dataset at ``metadata`` if it does not exist.
            demo_num_images: Number of images the demo dataset gets when generated.
        """
        super().__init__()
        problems = []
        if batch_size_per_device < 1:
            problems.append(f"data.batch_size_per_device = {batch_size_per_device}: must be >= 1")
        if not 0 <= val_fraction < 1:
            problems.append(f"data.val_fraction = {val_fraction}: must be in [0, 1)")
        if num_workers < 0:
            problems.append(f"data.num_workers = {num_workers}: must be >= 0 (0 loads in the training process)")
        if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
            problems.append(f"data.mean = {list(mean)}, data.std = {list(std)}: need 3 values each, std > 0")
        ConfigError.collect(problems)
        from lit_dist.data.buckets import make_buckets

        self.bucket_sizes = make_buckets(resolution, alignment, max_aspect)  # validates those three
        self.metadata = metadata
        self.root = root if root is not None else os.path.dirname(metadata) or "."
        self.batch_size_per_device = batch_size_per_device
        self.random_crop = random_crop
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.storage_options = storage_options
        self.create_demo_if_missing = create_demo_if_missing
        self.demo_num_images = demo_num_images
        self.mean = torch.tensor(mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std).view(1, 3, 1, 1) * 255
        self.classes: list[str] | None = None
        self._splits: dict = {}

    def prepare_data(self) -> None:
        # Lightning runs this on local rank 0 of each node while the other ranks wait.
        if self.create_demo_if_missing and not os.path.exists(self.metadata):
            from lit_dist.data.demo import create_shapes_dataset

            rank_zero_info(f"lit-dist: demo dataset not found at {self.metadata}; generating it (once)")
            create_shapes_dataset(self.metadata, num_images=self.demo_num_images, seed=self.seed)

    def setup(self, stage: str) -> None:
        if self._splits:
            return
        from lit_dist.data.buckets import assign_buckets
        from lit_dist.data.metadata import hash_split, read_metadata

        meta = read_metadata(self.metadata, self.storage_options)
        if meta.skipped_rows:
            rank_zero_warn(f"lit-dist: skipped {meta.skipped_rows} rows of {self.metadata} without a filename or a positive width/height")
        self.classes = meta.classes
        splits = meta.splits if meta.splits is not None else hash_split(meta.filenames, self.val_fraction)
        bucket_ids = assign_buckets(meta.widths, meta.heights, self.bucket_sizes)
        for split in ("train", "val", "test"):
            rows = np.flatnonzero(splits == split)
            self._splits[split] = self._dataset(meta, rows, bucket_ids[rows], random_crop=self.random_crop and split == "train")
        everything = np.arange(len(meta))
        self._splits["predict"] = self._dataset(meta, everything, bucket_ids, random_crop=False)
        if len(self._splits["train"]) == 0 and stage == "fit":
            raise DataError(f"data.metadata = {self.metadata!r} has no training rows (split column or data.val_fraction)")
        if len(self._splits["test"]) == 0:  # tables without a test split evaluate `test` on the validation rows
            self._splits["test"] = self._splits["val"]

    def _dataset(self, meta, rows: np.ndarray, bucket_ids: np.ndarray, random_crop: bool):
        from lit_dist.data.dataset import BucketImageDataset

        return BucketImageDataset(
            root=self.root,
            filenames=meta.filenames[rows],
            bucket_sizes=self.bucket_sizes,
            bucket_ids=bucket_ids,
            labels=None if meta.labels is None else meta.labels[rows],
            rows=meta.rows[rows],
            random_crop=random_crop,
            seed=self.seed,
            storage_options=self.storage_options,
        )

    def _loader(self, split: str, shuffle: bool, distributed: bool = True) -> torch.utils.data.DataLoader:
        from lit_dist.data.sampler import BucketBatchSampler

        dataset = self._splits[split]
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if (trainer and distributed) else (1, 0)
        sampler = BucketBatchSampler(dataset.bucket_ids, self.batch_size_per_device, world_size, rank, self.seed, shuffle)
        if shuffle:
            self._check_buckets(sampler, dataset)
        return torch.utils.data.DataLoader(
            dataset,
            sampler=sampler,
            batch_size=None,  # the dataset returns whole batches
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def _check_buckets(self, sampler, dataset) -> None:
        g = sampler.global_batch_size
        small = [(tuple(self.bucket_sizes[dataset.bucket_ids[m[0]]]), len(m)) for m in sampler.members if len(m) < g]
        if small and len(sampler) == 0:
            raise DataError(
                f"every bucket is smaller than one global batch ({g} = data.batch_size_per_device x world size), so "
                f"an epoch would have zero batches. Buckets (width, height): samples = {dict(small)}. "
                f"Lower data.batch_size_per_device, or use fewer, larger buckets (raise data.alignment or lower data.max_aspect)."
            )
        if small:
            rank_zero_warn(f"lit-dist: buckets smaller than one global batch ({g}) are unused this epoch: {dict(small)}")

    def train_dataloader(self):
        return self._loader("train", shuffle=True)

    def val_dataloader(self):
        return self._loader("val", shuffle=False)

    def test_dataloader(self):
        return self._loader("test", shuffle=False)

    def predict_dataloader(self):
        # Every row of the table. Lightning splits the batches of one sampler among ranks itself when predicting.
        return self._loader("predict", shuffle=False, distributed=False)

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        image = batch["image"].float()  # (B, C, H, W), 0..255
        batch["image"] = (image - self.mean.to(image.device)) / self.std.to(image.device)
        return batch
