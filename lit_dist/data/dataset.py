"""Decoding and cropping images to their bucket size; one call returns one whole batch.

The sampler hands over ``(epoch, indices)`` for a batch of one bucket, so the
dataset returns the collated batch itself: one round trip per batch between
worker and trainer, and the epoch is known for the random crop.
"""

import logging

import numpy as np
import torch

from lit_dist.cache.shards import from_stored
from lit_dist.ckpt.files import is_local
from lit_dist.reading.crops import centre_crop, centre_offsets, covering_size, crop_offsets
from lit_dist.reading.decode import covering as decode_covering
from lit_dist.reading.decode import covering_mask, covering_with_alpha, guard_against_bombs, reason
from lit_dist.reading.masks import Masks, full
from lit_dist.reading.tags import CaptionRule, ordered
from lit_dist.reading.unreadable import (
    MISSING,
    BadImage,
    BadSample,
    UnreadableInARow,
    permission_denied,
)
from lit_dist.reading.workers import reading
from lit_dist.runtime import outage

log = logging.getLogger(__name__)
_MAX_IN_A_ROW = 8  # bad samples of one bucket tried in a row before the batch gives up: the data is broken


class BucketImageDataset(torch.utils.data.Dataset):
    """Images resized to cover their bucket and cropped to it, as uint8 tensors.

    A batch is a dict: ``image`` (B, H, W, 3) uint8 (the data module makes it (B, 3, H, W) float on the device), ``label`` (B,) int64 when the
    table has labels, ``row`` (B,) int64, the metadata table row of each sample, and ``weight``
    (B,) float32: 0 for padding that evaluation metrics must not count. Given ``sizes``, also ``time_ids`` (B, 6)
    float32: each image's original height and width, its crop's top and left in the covering image, and the
    bucket's height and width (SDXL's size and crop conditioning, in its order). Given ``captions`` (training's
    ``CaptionRule``): each sample's cached caption and ``caption`` text in its tag order, and ``caption_dropout``
    (B,) float32 where its dataset sets its own rate. Given ``masks``: ``mask`` (B, H, W) uint8, each image's loss
    mask cropped as it is (255 counts), or from the cache beside its encoder outputs, on their grid.
    """

    def __init__(
        self,
        root: str,
        filenames: np.ndarray,
        bucket_sizes: np.ndarray,
        bucket_ids: np.ndarray,
        labels: np.ndarray | None = None,
        rows: np.ndarray | None = None,
        extra: dict | None = None,
        random_crop: bool = False,
        seed: int = 0,
        storage_options: dict | None = None,
        outage_deadline_s: float = outage.DEADLINE_S,
        max_image_pixels: int | None = 178_956_970,
        positions: np.ndarray | None = None,
        cache: dict | None = None,
        load_images: bool = True,
        fill=None,
        sizes: np.ndarray | None = None,
        members: np.ndarray | None = None,
        captions: CaptionRule | None = None,
        masks: Masks | None = None,
    ):
        self.url = root
        self.storage_options = storage_options or {}
        self.outage_deadline_s = outage_deadline_s
        self._fs, self._fs_pid, self.root = None, None, None
        # The whole table's columns, shared by every split (and by forked loader workers): a split is
        # ``positions``, the table position of each of its samples, not a copy of names and captions.
        self.filenames = filenames  # pyarrow string array: one shared buffer, no per-row Python objects
        self.extra = extra or {}  # name -> pyarrow array passed through to batches
        self.labels = labels
        self.positions = positions if positions is not None else np.arange(len(filenames))
        self.max_image_pixels = max_image_pixels
        self._open_fs()  # also resolves self.root
        self.bucket_sizes = bucket_sizes  # (K, 2) of (width, height)
        self.bucket_ids = bucket_ids
        self.rows = rows if rows is not None else self.positions
        self.random_crop = random_crop
        self.seed = seed
        # Cached fields by batch key ("pixels" stands for `image`), each a FieldView by table position.
        self.cache = cache or {}
        for view in self.cache.values():  # a cache on an object store waits out an outage as images do
            view.outage_deadline_s = outage_deadline_s
        self.load_images = load_images  # False when only encoder outputs are cached: no image is opened
        self.fill = fill  # data.cache.mode ondemand: a FillKeys, which says what missing entries are written as
        self.sizes = sizes  # (N, 2) int32 original (width, height) by table position: batches get time_ids
        # (N, 2) int64 (offset, length) by table position: each image is a byte range of the file its name's part
        # before "#" names (a Hugging Face dataset's Arrow file, a tar shard), not a file of its own.
        self.members = members
        # Training's: each sample's tag order (its cached caption and its caption text), its dataset's caption dropout.
        self.captions = captions
        self.masks = masks  # where its loss masks come from (decoded with the images; a cache has them beside latents)
        self._ranges = None  # reading.members.Members, made on the first read in each process
        self._members: list[np.ndarray] | None = None  # per bucket, built on the first bad image only
        self._logged: set[int] = set()  # bad samples already reported by this process
        # Made in the training process (loader workers get a copy): which rank's log line it is.
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self._who = f"rank {torch.distributed.get_rank()}: " if group and torch.distributed.get_world_size() > 1 else ""

    def __len__(self) -> int:
        return len(self.positions)

    def _open_fs(self):
        """The filesystem, made anew in each process: an s3fs client carried into a forked loader
        worker still points at the parent's event loop and never answers."""
        import os


        if self._fs_pid != os.getpid():
            self._fs, root = outage.url_to_fs(self.url, **self.storage_options)
            self.root, self._fs_pid = root.rstrip("/"), os.getpid()
            guard_against_bombs(self.max_image_pixels)
        return self._fs

    def __getstate__(self) -> dict:
        state = {**self.__dict__, "_fs": None, "_fs_pid": None, "_ranges": None}
        if len(self.positions) < len(self.filenames):
            # Pickled for a spawned loader worker (forked ones share the parent's columns): send
            # this split's rows only, not the whole table.
            import pyarrow as pa

            take = pa.array(self.positions)
            state.update(filenames=self.filenames.take(take), extra={k: v.take(take) for k, v in self.extra.items()},
                         members=None if self.members is None else self.members[self.positions],
                         labels=None if self.labels is None else self.labels[self.positions],
                         cache={k: v.take(self.positions) for k, v in self.cache.items()},
                         fill=None if self.fill is None else self.fill.take(self.positions),
                         sizes=None if self.sizes is None else self.sizes[self.positions],
                         masks=None if self.masks is None else self.masks.take(self.positions),
                         positions=np.arange(len(self.positions)), _members=None)
        return state

    def __getitem__(self, request: tuple[int, list[int], float]) -> dict[str, torch.Tensor]:
        epoch, indices, weight = request
        width, height = self.bucket_sizes[self.bucket_ids[indices[0]]]
        image, images = _batch_buffer((len(indices), height, width, 3)) if self.load_images else (None, None)  # (B, H, W, C)
        arrays: dict[str, list[tuple[int, np.ndarray]]] = {}  # batch key -> (slot, array) of the samples that have it
        used = np.empty(len(indices), dtype=np.int64)
        time_ids = np.empty((len(indices), 6), dtype=np.float32) if self.sizes is not None else None
        # Decoded with the images; where they are not loaded, a cache holds the masks beside the encoder outputs.
        masks = np.empty((len(indices), height, width), np.uint8) if self.masks is not None and self.load_images else None
        orders = np.zeros(len(indices), dtype=np.int64)  # each sample's tag order (reading/tags.py)
        failures = 0
        # Images that are byte ranges of larger files, decoded here (no pixel cache): neighbours read together.
        decoded = self.members is not None and self.load_images and "pixels" not in self.cache
        together = self.read_together(indices) if decoded else {}
        for slot, index in enumerate(indices):
            used[slot], failed, sample = self._load(index, epoch, width, height, together)
            failures += failed
            if images is not None:
                images[slot] = sample.pop("image")
            if self.sizes is not None:
                time_ids[slot] = sample.pop("time_ids")
            if masks is not None:
                masks[slot] = sample.pop("mask")
            orders[slot] = sample.pop("_tag_order", 0)
            for key, array in sample.items():
                arrays.setdefault(key, []).append((slot, array))
        batch = {
            "row": torch.from_numpy(self.rows[used]),
            "weight": torch.full((len(indices),), weight, dtype=torch.float32),
            "bad_samples": torch.tensor(failures),  # images of this batch that were replaced
        }
        if image is not None:
            # Channels last, as decoded: the permute to (B, C, H, W) is a free view on the device
            # instead of a copy in the worker.
            batch["image"] = image  # (B, H, W, C) uint8
        if time_ids is not None:
            batch["time_ids"] = torch.from_numpy(time_ids)
        if masks is not None:
            batch["mask"] = torch.from_numpy(masks)
        at = self.positions[used]
        if self.fill is not None:  # data.cache.mode ondemand: what this batch made for the cache
            batch.update(self.fill.batch_parts(arrays, at, {k: v.dtype for k, v in self.cache.items()}))
        for key, items in arrays.items():
            batch[key] = from_stored(np.stack([a for _, a in items]), self.cache[key].dtype)  # (B, ...) as stored
        if self.labels is not None:
            batch["label"] = torch.from_numpy(self.labels[at])
        for name, column in self.extra.items():
            batch[name] = _column_batch(column.take(at))
        if self.captions is not None:
            if orders.any() and "caption" in batch:  # the text of the order each sample's cached caption is in
                keep = self.captions.keep_tokens
                batch["caption"] = [ordered(t, int(k), keep) if t else t
                                    for t, k in zip(batch["caption"], orders, strict=True)]
            if self.captions.caption_dropout is not None:  # this dataset's rate: the objective reads it
                batch["caption_dropout"] = torch.full((len(indices),), self.captions.caption_dropout)
        return batch

    def _load(self, index: int, epoch: int, width: int, height: int, together: dict) -> tuple[int, int, dict]:
        """Sample ``index`` (its image cropped to the bucket, its cached fields), a bad one replaced by the
        next sample of its bucket. Returns the sample used, how many failed before it, and its arrays.

        Only a bad sample is replaced (``reading/unreadable.py``): a missing file, bytes that do not decode, a bomb,
        a missing or damaged cache entry. Anything else (a bug, a permission error, an outage) propagates.
        ``together``: image bytes already read with their neighbours (``read_together``), by sample.
        """
        candidate, tried, last = index, [], None
        for attempt in range(_MAX_IN_A_ROW):
            try:
                return candidate, attempt, self._sample(candidate, epoch, width, height, together.get(candidate))
            except BadSample as exc:
                tried.append(candidate)
                last = exc
                if candidate not in self._logged:
                    self._logged.add(candidate)
                    log.warning("lit-dist: %scannot read %s (%s); using another image of the same bucket",
                                self._who, self._path(candidate), reason(exc))
                candidate = self._next_in_bucket(candidate)
                if candidate in tried:  # a small bucket: every one of its samples was tried
                    break
        names = ", ".join(self.filenames[int(self.positions[i])].as_py() for i in tried)
        raise UnreadableInARow(
            f"{self._who}{len(tried)} samples in a row of bucket {width}x{height} could not be read, under "
            f"{self.url}: {names} (the last: {reason(last)}). So many bad ones together mean a wrong data.root, a "
            "damaged cache (lit-dist cache --check) or a damaged copy of the dataset") from last

    def _sample(self, index: int, epoch: int, width: int, height: int, data: bytes | None = None) -> dict[str, np.ndarray]:
        position = int(self.positions[index])
        sample, encode, crop = {}, False, None
        order = self.captions.order(self.seed, epoch, index) if self.captions is not None else 0
        if order:
            sample["_tag_order"] = order
        for key, view in self.cache.items():
            if key == "pixels":
                continue
            if self.fill is not None and view.shard[position] < 0:
                encode = True  # ondemand: the device encodes it, from the centre crop sent along
            else:
                sample[key] = view.read(position, order if view.orders > 1 else 0)
        if self.load_images or encode:
            pixels, mask = self.cache.get("pixels"), None
            if pixels is not None and not (self.fill is not None and pixels.shard[position] < 0):
                covering = pixels.read(position)
            else:
                # Masks never come with cached pixels (the data module refuses the two together).
                covering, mask = self.covering_and_mask(index, width, height, data)
                if pixels is not None:  # ondemand: the training process writes it to the cache
                    sample["_fill_pixels"] = (position, covering)
            if self.load_images:
                left, top = self._offsets(covering.shape[1], covering.shape[0], width, height, epoch, index)
                sample["image"] = covering[top : top + height, left : left + width]  # (H, W, C)
                if mask is not None:
                    sample["mask"] = mask[top : top + height, left : left + width]  # (H, W), cropped with its image
                crop = left, top
            if encode:
                sample["_encode_input"] = (position, centre_crop(covering, width, height))
        if self.sizes is not None:
            original_width, original_height = (int(v) for v in self.sizes[position])
            if crop is None:
                # Only encoder outputs read: they were made from the centre crop of the image resized to cover the
                # bucket, whose size follows from the table's (a JPEG decoded at a reduced scale may differ by a
                # pixel or so: SDXL's conditioning is coarser than that).
                crop = centre_offsets(*covering_size(original_width, original_height, width, height), width, height)
            left, top = crop
            sample["time_ids"] = np.array([original_height, original_width, top, left, height, width], np.float32)
        return sample

    def _next_in_bucket(self, index: int) -> int:
        if self._members is None:
            self._members = [np.flatnonzero(self.bucket_ids == b) for b in range(len(self.bucket_sizes))]
        members = self._members[self.bucket_ids[index]]
        pos = int(np.searchsorted(members, index))
        return int(members[(pos + 1) % len(members)])

    def _path(self, index: int) -> str:
        return f"{self.root}/{self.filenames[int(self.positions[index])].as_py()}"

    def covering(self, index: int, width: int, height: int, data: bytes | None = None) -> np.ndarray:
        """Image ``index`` decoded and resized to cover (width, height) whole, uncropped: (H', W', 3) uint8; its
        bytes read here unless given as ``data``.

        This is what a pixel cache stores: the crop is left to load time, so it varies as it does without one.
        """
        return decode_covering(self._image_bytes(index, data), width, height)

    def covering_and_mask(self, index: int, width: int, height: int,
                          data: bytes | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """``covering`` and, where the dataset has masks, the image's loss mask at its covering size (H', W') uint8:
        its alpha channel, or its mask file (a missing or undecodable one makes the sample bad), 255 where it has
        none; None without masks."""
        if self.masks is None:
            return self.covering(index, width, height, data), None
        if self.masks.alpha:
            return covering_with_alpha(self._image_bytes(index, data), width, height)
        covering = self.covering(index, width, height, data)
        name = self.masks.name(int(self.positions[index]))
        if name is None:
            return covering, full(*covering.shape[:2])
        path = f"{self.root}/{name}"
        try:
            with reading(path):
                mask = outage.call(lambda: self._read_bytes(path), path, self.outage_deadline_s, self._who)
        except MISSING as exc:
            raise BadImage(f"its mask {name} is missing ({reason(exc)})") from exc
        except PermissionError as exc:
            raise permission_denied(path, exc) from exc
        return covering, covering_mask(mask, (covering.shape[1], covering.shape[0]))

    def _image_bytes(self, index: int, data: bytes | None) -> bytes:
        """Image ``index``'s file bytes (``data`` where already read); a missing file is a bad image."""
        if data is not None:
            return data
        path = self._path(index)
        read = self._read_bytes if self.members is None else self._member_reader(index)
        try:  # the bytes first: an error of the storage is told apart from bytes that do not decode
            with reading(path):  # a hang dump names the file
                # An outage is waited out (the same file read once the store answers), never a bad image.
                return outage.call(lambda: read(path), path, self.outage_deadline_s, self._who)
        except MISSING as exc:
            raise BadImage(f"missing ({reason(exc)})") from exc
        except PermissionError as exc:
            raise permission_denied(path, exc) from exc

    def _read_bytes(self, path: str) -> bytes:
        fs = self._open_fs()
        if is_local(fs):  # Python's own open: fsspec's local file object costs 114 us a file against 49
            with open(path, "rb") as f:
                return f.read()
        with fs.open(path, "rb") as f:
            return f.read()

    def _member_reader(self, index: int):
        """Reads sample ``index``'s byte range of its file (the name before "#" in ``path``)."""
        ranges = self._member_ranges()
        offset, length = (int(v) for v in self.members[int(self.positions[index])])
        return lambda path: ranges.read(path.rsplit("#", 1)[0], offset, length)

    def _member_ranges(self):
        from lit_dist.reading.members import Members

        fs = self._open_fs()
        if self._ranges is None or self._ranges.fs is not fs:
            self._ranges = Members(fs)
        return self._ranges

    def read_together(self, indices) -> dict[int, bytes]:
        """The image bytes of the samples ``indices`` that lie near each other in one file, by sample: each run of
        neighbours read with one request (one ranged GET instead of one a sample on an object store); {} where
        images are files of their own. A run whose read fails leaves its samples to be read one by one, each then
        counted or raised as its own.
        """
        if self.members is None:
            return {}
        ranges, spans = self._member_ranges(), {}
        for index in dict.fromkeys(int(i) for i in indices):
            offset, length = (int(v) for v in self.members[int(self.positions[index])])
            spans.setdefault(self._path(index).rsplit("#", 1)[0], []).append((offset, length, index))
        together = {}
        for path, items in spans.items():
            for start, end, run in ranges.runs(items):
                if len(run) < 2:
                    continue
                try:
                    with reading(path):
                        data = outage.call(lambda p=path, s=start, e=end: ranges.read_upto(p, s, e - s), path,
                                           self.outage_deadline_s, self._who)
                except (*MISSING, PermissionError):
                    continue
                for offset, length, index in run:
                    piece = data[offset - start : offset - start + length]
                    if len(piece) == length:  # a truncated file: the samples past its end are read (and fail) alone
                        together[index] = piece
        return together

    def _offsets(self, covering_width: int, covering_height: int, width: int, height: int, epoch: int,
                 index: int) -> tuple[int, int]:
        """(left, top) of sample ``index``'s crop to (width, height) in its covering image."""
        free_x, free_y = covering_width - width, covering_height - height
        if self.random_crop and (free_x or free_y):
            # From (seed, epoch, index) alone: a resumed run crops exactly as an uninterrupted one.
            return crop_offsets(self.seed, epoch, index, free_x, free_y)
        return centre_offsets(covering_width, covering_height, width, height)


def _batch_buffer(shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """A new uint8 tensor and its numpy view. In a loader worker it is allocated in shared memory at once, so
    handing the batch to the training process copies nothing (a tensor in ordinary memory is copied into
    shared memory on its way out); torch's own default_collate does the same with ``_new_shared``."""
    if torch.utils.data.get_worker_info() is None:
        tensor = torch.empty(shape, dtype=torch.uint8)
    else:
        storage = torch.UntypedStorage._new_shared(int(np.prod(shape)))
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    return tensor, tensor.numpy()


def _column_batch(values):
    """Numbers become a tensor; text and anything else a list (the default collate keeps lists as they are)."""
    import pyarrow as pa

    numeric = pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)
    if numeric and not values.null_count:
        return torch.from_numpy(values.to_numpy(zero_copy_only=False))
    return values.to_pylist()
