"""Where the images of a run come from: one or several datasets, each a table, a scanned folder, a Hugging Face
dataset folder or WebDataset tar shards.

Several datasets are mixed by weight (``data.datasets``); the single-dataset fields of
``BucketDataModule`` (``metadata``, ``scan_root``, ...) are shorthand for a list of one.
Each dataset's rows keep their own root, and a batch never mixes datasets, so a batch
is always one bucket of one dataset.
"""

from dataclasses import dataclass

import numpy as np
import torch

from lit_dist.errors import DataError
from lit_dist.reading.tags import CaptionRule

SOURCE_FIELDS = ("metadata", "scan_root", "hf_dataset", "webdataset")  # where a dataset's rows come from: one of them


@dataclass
class DatasetSource:
    """One dataset of a run.

    Args:
        metadata: Parquet table: a file, a folder of .parquet files or a glob, local or fsspec URL.
        scan_root: Instead of metadata: a folder of images (local or URL) to index by reading headers.
        root: Folder the filenames are relative to; default: the table's folder, or scan_root.
        weight: Share of each epoch's training batches, relative to the other datasets' weights.
        repeats: Times each of its training samples is seen per epoch (before weighting).
        labels_from_folders: With scan_root: the first folder level of each image is its label.
        index_cache: With scan_root or hf_dataset: where the index is kept; default ~/.cache/lit-dist/.
        hf_dataset: Instead of metadata: a Hugging Face dataset: a save_to_disk folder (local or URL), parquet files with an image column, or a hub id.
        image_column: With hf_dataset: the column of the images (datasets.Image or bytes).
        caption_column: The column of the captions; default caption (with hf_dataset: caption, text or prompt, whichever it has).
        label_column: With hf_dataset: the column of the labels; default label if present.
        webdataset: Instead of metadata: WebDataset tar shards, a brace pattern or a list (local or URLs).
        caption_dropout: Share of this dataset's training captions replaced by the empty caption; default: model.objective.condition_dropout.
        tag_orders: Orders of each caption's comma-separated tags that training draws from: as written and tag_orders - 1 shuffles, each cached once.
        keep_tokens: With tag_orders > 1: this many leading tags stay in front, in their order.
        mask_column: With metadata: the column of each image's loss mask, a path relative to root (white counts, black is ignored; empty: all counts).
        alpha_mask: Each image's alpha channel is its loss mask (opaque counts; an image without alpha counts everywhere).
    """

    metadata: str | None = None
    scan_root: str | None = None
    root: str | None = None
    weight: float = 1.0
    repeats: int = 1
    labels_from_folders: bool = False
    index_cache: str | None = None
    hf_dataset: str | None = None
    image_column: str = "image"
    caption_column: str | None = None
    label_column: str | None = None
    webdataset: str | list[str] | None = None
    caption_dropout: float | None = None
    tag_orders: int = 1
    keep_tokens: int = 0
    mask_column: str | None = None
    alpha_mask: bool = False

    def problems(self, where: str) -> list[str]:
        out = []
        given = {name: value for name, value in (("metadata", self.metadata), ("scan_root", self.scan_root),
                                                 ("hf_dataset", self.hf_dataset), ("webdataset", self.webdataset))
                 if value is not None}
        if len(given) != 1:
            shown = ", ".join(f"{name} = {value!r}" for name, value in given.items()) or "none is set"
            out.append(f"{where}: {shown}: set exactly one of {', '.join(SOURCE_FIELDS)}")
        if (self.hf_dataset is not None or self.webdataset is not None) and self.root is not None:
            out.append(f"{where}.root = {self.root!r}: a Hugging Face dataset or tar shards hold their images; remove "
                       "root")
        if self.weight <= 0:
            out.append(f"{where}.weight = {self.weight}: must be > 0")
        if self.repeats < 1:
            out.append(f"{where}.repeats = {self.repeats}: must be >= 1")
        if self.caption_dropout is not None and not 0.0 <= self.caption_dropout < 1.0:
            out.append(f"{where}.caption_dropout = {self.caption_dropout}: must be in [0, 1)")
        if self.tag_orders < 1:
            out.append(f"{where}.tag_orders = {self.tag_orders}: must be >= 1 (1: captions as written)")
        if self.keep_tokens < 0:
            out.append(f"{where}.keep_tokens = {self.keep_tokens}: must be >= 0")
        elif self.keep_tokens and self.tag_orders == 1:
            out.append(f"{where}.keep_tokens = {self.keep_tokens} keeps tags in front of shuffled ones, and "
                       f"{where}.tag_orders is 1 (captions as written): set tag_orders (e.g. 4), or remove keep_tokens")
        if self.mask_column is not None and self.alpha_mask:
            out.append(f"{where}.mask_column = {self.mask_column!r} and {where}.alpha_mask = true: a dataset's loss masks "
                       "come from one of them; remove the other")
        if self.mask_column is not None and self.metadata is None:
            out.append(f"{where}.mask_column = {self.mask_column!r} names mask files in a metadata table's column, and "
                       f"this dataset has no data.metadata table: use {where}.alpha_mask (masks in the images' alpha)")
        return out

    @property
    def masked(self) -> bool:
        """Whether this dataset's training loss is masked."""
        return self.mask_column is not None or self.alpha_mask

    @property
    def caption_rule(self) -> CaptionRule | None:
        """What training does to this dataset's captions; None when it reads them as written, at the objective's
        dropout."""
        rule = CaptionRule(self.tag_orders, self.keep_tokens, self.caption_dropout)
        return None if rule == CaptionRule() else rule

    @property
    def table_path(self) -> str:
        """The parquet table read: ``metadata``, or the cached index of ``scan_root``."""
        if self.metadata is not None:
            return self.metadata
        if self.hf_dataset is not None:
            from lit_dist.data.hf_dataset import default_index_path

            return self.index_cache or default_index_path(self.hf_dataset)
        if self.webdataset is not None:
            from lit_dist.data.webdataset import default_index_path

            return self.index_cache or default_index_path(self.webdataset)
        from lit_dist.data.discovery import default_cache_path

        return self.index_cache or default_cache_path(self.scan_root)

    @property
    def described(self) -> str:
        """What the rows come from, for a user: the table, or the source and the index lit-dist keeps of it."""
        if self.metadata is not None:
            return self.metadata
        if self.webdataset is not None:
            shards = self.webdataset if isinstance(self.webdataset, str) else ", ".join(self.webdataset)
            what = f"the tar shards {shards}"
        elif self.hf_dataset is not None:
            what = f"the Hugging Face dataset {self.hf_dataset}"
        else:
            what = f"the folder {self.scan_root}"
        return f"{what} (index {self.table_path})"

    @property
    def image_root(self) -> str:
        if self.root is not None:
            return self.root
        if self.hf_dataset is not None:
            from lit_dist.data.hf_dataset import root_of

            return root_of(self.hf_dataset)
        if self.webdataset is not None:
            from lit_dist.data.webdataset import common_root, shard_paths

            return common_root(shard_paths(self.webdataset))
        return self.scan_root if self.scan_root is not None else table_folder(self.metadata)

    @property
    def indexed(self) -> bool:
        """Whether lit-dist makes this dataset's table (a scan, a Hugging Face dataset, tar shards), rather than
        reading one."""
        return self.metadata is None

    @property
    def containers(self) -> bool:
        """Whether its images are byte ranges of larger files (a Hugging Face dataset's Arrow files, tar shards)."""
        return self.hf_dataset is not None or self.webdataset is not None


def table_folder(metadata: str) -> str:
    """The folder a table's filenames are relative to by default: the table's own folder."""
    path = metadata.rstrip("/")
    if path.endswith(".parquet") or any(c in path for c in "*?["):
        path = path.split("*")[0].split("?")[0].split("[")[0]
        path = path.rsplit("/", 1)[0] if "/" in path else "."
    return path or "."


def merge_labels(metas: list) -> list[str] | None:
    """Give every dataset the same class indices: string labels map into the sorted union of names."""
    kinds = {m.labels is None for m in metas}
    if len(kinds) > 1:
        raise DataError("some datasets have a label column and others do not; give all of them labels, or none")
    named = [m.classes is not None for m in metas if m.labels is not None]
    if not named:
        return None
    if len(set(named)) > 1:
        raise DataError("some datasets have integer labels and others strings; use one kind for all of them")
    if not named[0]:
        return None
    classes = sorted(set().union(*(m.classes for m in metas)))
    lookup = {name: i for i, name in enumerate(classes)}
    for m in metas:
        m.labels = np.array([lookup[c] for c in m.classes], dtype=np.int64)[m.labels]
        m.classes = classes
    return classes


class MixedDataset:
    """Several BucketImageDatasets behind one index space; a batch request goes to the dataset it falls in."""

    def __init__(self, parts: list, bucket_ids: np.ndarray):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.bucket_ids = bucket_ids  # group ids: dataset x bucket

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, request: tuple[int, list[int], float]) -> dict:
        epoch, indices, weight = request
        part = int(np.searchsorted(self.offsets, indices[0], side="right")) - 1
        batch = self.parts[part][(epoch, [i - int(self.offsets[part]) for i in indices], weight)]
        batch["dataset"] = torch.full((len(indices),), part, dtype=torch.int64)
        return batch
