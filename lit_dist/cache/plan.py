"""What a run needs from its cache: every sample of every dataset, keyed per cached field.

``CachePlan`` is made from the data module's datasets (all rows: train, val, test and
predict read the same cache) and the ``data.cache`` config. It knows each field's
fingerprint, each sample's id and key, and turns the published index into per-dataset
views for the loader, with the coverage a user is shown.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from lit_dist.cache import captions, keys
from lit_dist.cache.config import CacheConfig
from lit_dist.cache.reader import Coverage, FieldIndex
from lit_dist.cache.shards import ShardWriter
from lit_dist.cache.store import CacheStore
from lit_dist.errors import DataError

STORED_DTYPE = {"pixels": "uint8", "mask": "uint8"}


@dataclass
class DatasetNeed:
    """One dataset's samples: the dataset that decodes them, their bucket sizes, ids and keys per field."""

    images: object  # a BucketImageDataset over all rows of the table, centre crops
    sizes: np.ndarray  # (n, 2) bucket (width, height) of each row
    samples: np.ndarray  # uint64 id of each row
    identity: np.ndarray | None = None  # uint64 version of each source file (size and mtime, or ETag); set by plan_for
    captions: object = None  # pyarrow strings, for a caption encoder
    root_field: tuple[str, str] = ("data.root", "")  # the config field of its image root, and how it is set
    keys: dict[str, np.ndarray] = field(default_factory=dict)  # field -> uint64 key of each entry
    # The caption field holds tag_orders entries per row, order-major (entry k * rows + row: reading/tags.py), each a
    # sample of its own (caption_samples, set by the plan); order 0 is the caption as written.
    tag_orders: int = 1
    keep_tokens: int = 0
    caption_samples: np.ndarray | None = None
    # Its loss masks (reading.masks.Masks; None: none) and each row's mask source (keys.mask_sources), in a run whose
    # cache has a mask field: that of any dataset's masks beside an encoder's outputs.
    masks: object = None
    mask_identity: np.ndarray | None = None

    def orders(self, name: str) -> int:
        """Entries per row of field ``name``: its tag orders for captions, else one."""
        return self.tag_orders if name == "caption_encoder" else 1

    def samples_of(self, name: str) -> np.ndarray:
        """The uint64 id of each entry of field ``name``, order-major."""
        return self.caption_samples if name == "caption_encoder" else self.samples

    def entries(self, name: str, found: np.ndarray) -> np.ndarray:
        """``found`` (one value per entry of field ``name``) as (rows, entries per row)."""
        return found.reshape(self.orders(name), -1).T


class CachePlan:
    """The cache of a run: its store, its fields' fingerprints, and what each dataset needs."""

    def __init__(self, config: CacheConfig, needs: list[DatasetNeed], buckets: dict, mean, std,
                 storage_options: dict | None = None):
        self.config = config
        self.store = CacheStore(config.dir, storage_options)
        self.needs = needs
        self.mean, self.std = tuple(mean), tuple(std)
        self._scales: dict = {}  # device -> (mean, std) x 255, made once per device
        from lit_dist.cache.encoders import TORCH_DTYPES

        self._compute = TORCH_DTYPES[config.compute]  # the encoders' dtype, and so their inputs'
        self.fields = config.fields()
        if "encoder" in self.fields and any(need.masks is not None for need in needs):
            self.fields.append("mask")  # loss masks on the encoder's grid, beside its outputs (reading/masks.py)
        self._loaded: dict = {}  # field -> its encoder, loaded when first needed (a complete cache needs none)
        self.captions = None  # captions.Captions of a multi-field caption encoder, once read (read_captions)
        self.grids: dict = {}  # bucket (width, height) -> the encoder output's (h, w), once checked (build.check_encoder)
        # The bucket settings are in every description: entries of another resolution are named as such.
        self.descriptions = {"pixels": {"field": "pixels", **keys.PIXEL_RULE, "buckets": buckets}}
        if config.encoder is not None:
            from lit_dist.cache.encoders import description

            inputs = {"crop": "centre of the bucket-sized image", "mean": list(mean), "std": list(std)}
            self.descriptions["encoder"] = {**description(config.encoder, lambda: self.encoder, config.encoder_dtype,
                                                          compute=config.compute, **inputs), "buckets": buckets}
        if "mask" in self.fields:
            from lit_dist.reading.masks import MASK_RULE

            self.descriptions["mask"] = {"field": "mask", **MASK_RULE, "encoder": self.descriptions["encoder"]}
        if config.caption_encoder is not None:
            from lit_dist.cache.encoders import description

            self.descriptions["caption_encoder"] = description(config.caption_encoder, lambda: self.caption_encoder,
                                                               config.encoder_dtype, "caption_encoder",
                                                               compute=config.compute, text="the caption column")
        self.fingerprints = {f: keys.fingerprint(self.descriptions[f]) for f in self.fields}
        for need in needs:
            need.keys = {f: self._keys(need, f) for f in self.fields}

    @property
    def encoder(self):
        """data.cache.encoder as a frozen module on the CPU (None without one), loaded on first use."""
        return self._load("encoder")

    @property
    def caption_encoder(self):
        """data.cache.caption_encoder as a frozen module on the CPU (None without one), loaded on first use."""
        return self._load("caption_encoder")

    def _load(self, field: str):
        spec = getattr(self.config, field)
        if spec is None:
            return None
        if field not in self._loaded:
            from lit_dist.cache.encoders import load_encoder

            self._loaded[field] = load_encoder(spec, field, self.config.compute)
        return self._loaded[field]

    def record_captions(self) -> None:
        """Rank 0 at a build: the empty caption (and with it the layout) of a multi-field caption encoder."""
        if self.config.caption_encoder is not None:
            captions.record(self.store, self.fingerprints["caption_encoder"], lambda: self.caption_encoder,
                            self.config.encoder_dtype)

    def read_captions(self) -> None:
        """Every rank: the layout and empty caption a multi-field caption cache was built with (None otherwise)."""
        if self.config.caption_encoder is not None:
            from lit_dist.cache.encoders import encoder_class

            self.captions = captions.load(self.store, self.fingerprints["caption_encoder"])
            if self.captions is None and hasattr(encoder_class(self.config.caption_encoder, "caption_encoder"),
                                                 "empty_caption"):
                raise DataError(f"data.cache.dir = {self.config.dir!r} lacks caption_encoder/{captions.FOLDER}/"
                                f"{self.fingerprints['caption_encoder']}.npz, the empty caption of its caption "
                                "encoder: run `lit-dist cache --config <this config>`, which writes it")

    def _keys(self, need: DatasetNeed, name: str) -> np.ndarray:
        if name == "caption_encoder":  # the caption's text (and tag order) is its source; not the image or bucket
            hashes = keys.name_hashes(need.captions)
            orders = [keys.caption_order(need.samples, hashes, k, need.keep_tokens) for k in range(need.tag_orders)]
            need.caption_samples = np.concatenate([samples for samples, _ in orders])
            sources = np.concatenate([source for _, source in orders])
            return keys.entry_keys(need.caption_samples, sources, np.zeros((len(sources), 2), need.sizes.dtype),
                                   self.fingerprints[name])
        if name == "mask":
            return keys.entry_keys(need.samples, need.mask_identity, need.sizes, self.fingerprints[name])
        return keys.entry_keys(need.samples, need.identity, need.sizes, self.fingerprints[name])

    def normalised(self, crops: torch.Tensor) -> torch.Tensor:
        """Encoder input: uint8 crops (B, H, W, 3) as float (B, 3, H, W), normalised as training batches are, in the
        dtype the encoders run in."""
        if crops.device not in self._scales:
            mean = torch.tensor(self.mean, device=crops.device).view(1, 3, 1, 1) * 255
            self._scales[crops.device] = mean, torch.tensor(self.std, device=crops.device).view(1, 3, 1, 1) * 255
        mean, std = self._scales[crops.device]
        return ((crops.permute(0, 3, 1, 2).float() - mean) / std).to(self._compute)

    def dtype(self, name: str) -> str:
        return STORED_DTYPE.get(name, self.config.encoder_dtype)

    def writer(self, name: str) -> ShardWriter:
        """A shard writer for field ``name`` as data.cache configures it (builds and ondemand alike)."""
        cfg = self.config
        return ShardWriter(self.dtype(name), cfg.compression, cfg.compression_level, cfg.min_savings, cfg.pixel_layout)

    def batch_key(self, name: str) -> str:
        """The batch key a field's arrays travel under ("pixels" become the `image` crop)."""
        return {"pixels": "pixels", "encoder": self.config.encoder_key, "caption_encoder": self.config.caption_key,
                "mask": "mask"}[name]

    def match(self) -> tuple[list[dict], dict[str, Coverage]]:
        """Per dataset {field: entry positions in the index, -1 if none}, the indexes, and each field's coverage."""
        found: list[dict] = [{} for _ in self.needs]
        coverage = {f: Coverage(f) for f in self.fields}
        self.indexes = {}
        for name in self.fields:
            shards = self.store.manifest(name)["shards"]
            try:
                index = FieldIndex(self.store, name, shards)
            except (OSError, ValueError) as exc:
                raise DataError(f"data.cache.dir = {self.config.dir!r}: the index of {name} cannot be read ({exc}); "
                                f"run `lit-dist cache --config ... --check`, or rebuild") from exc
            self.indexes[name] = index
            for i, need in enumerate(self.needs):
                found[i][name], cov = index.match(need.samples_of(name), need.keys[name])
                coverage[name].add(cov)
        return found, coverage

    def views(self, found: list[dict]) -> list[dict]:
        """Per dataset, {batch key: FieldView} for the loader."""
        views = [{self.batch_key(name): self.indexes[name].view(entries, self.dtype(name), need.orders(name))
                  for name, entries in f.items()}
                 for f, need in zip(found, self.needs, strict=True)]
        self.indexes = {}  # the sorted index (about 50 bytes per entry) is not kept: the views are what a run reads
        return views

    def describe_other(self, name: str, fingerprints: tuple) -> str:
        """What the stale entries of field ``name`` were built for, and what differs, in a few words: another
        configuration (named by ``configs.json``), or this one from source files that changed since."""
        configs = self.store.configs(name)
        ours = self.descriptions[name]
        parts = []
        for fp in fingerprints:
            if fp == self.fingerprints[name]:  # same configuration, other key: the source file or its size changed
                parts.append("stale entries are of this configuration, built from source files that changed since "
                             "(their size, modification time or ETag, or the table's width and height)")
                continue
            theirs = configs.get(fp)
            if theirs is None:
                what = f"what differs is unknown: {name}/configs.json does not describe it"
            else:
                changed = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
                what = f"differs in {', '.join(changed) or 'nothing recorded'}"
            parts.append(f"stale entries were built for another configuration: {fp} ({what})")
        return "; ".join(parts)
