"""``CacheConfig``: the ``data.cache`` section of a run config.

Example (YAML)::

    data:
      cache:
        dir: /scratch/caches/photos          # or s3://bucket/caches/photos
        mode: build                          # read | build | ondemand | off
        pixels: true                         # images resized to cover their bucket, uint8
        encoder:                             # a frozen torch.nn.Module applied to the centre crop
          class_path: lit_dist.cache.encoders.VAEEncoder
          init_args: {config: {latent_channels: 4}}
        encoder_dtype: bf16
        caption_encoder:                     # a frozen module: list of captions -> tensor (B, ...)
          class_path: my_project.text.CaptionEncoder
"""

from dataclasses import dataclass
from typing import Literal

MODES = ("read", "build", "ondemand", "off")
DTYPES = ("bf16", "fp16", "fp32")
PIXEL_LAYOUTS = ("row_tree", "rows", "plain")  # see cache/shards.py: ROW_TREE, ROWS, PLAIN


@dataclass
class CacheConfig:
    """Where and what to cache.

    Args:
        dir: Cache folder, a local path or an fsspec URL (s3://bucket/cache); unset: no cache.
        mode: read (fail if anything is missing), build (build what is missing at the start of fit), ondemand
            (make what is missing while training, read it from the next epoch on), off.
        pixels: Cache each image resized to cover its bucket (uint8); the crop still happens at load.
        encoder: A frozen torch.nn.Module as {class_path, init_args}, applied to the centre crop of each image.
        encoder_dtype: dtype the encoder and caption encoder outputs are stored in: bf16, fp16 or fp32.
        compute_dtype: dtype the encoders run in while caching: fp32, or bf16/fp16 for half their memory (a T5-XXL
            19 GB -> 9.5 GB); auto: bf16 for a pipeline's encoders under a bf16 trainer.precision, else fp32.
        encoder_key: Batch key of the encoder outputs, (B, ...), float32 on the device.
        caption_encoder: A frozen torch.nn.Module as {class_path, init_args} mapping a list of captions to (B, ...).
        caption_key: Batch key of the caption encoder outputs, (B, ...), float32 on the device.
        encoder_batch_size: Images per encoder call while building; default: data.batch_size_per_device.
        compression: zstd or none; compressed per sample, so reading one sample reads its bytes only.
        compression_level: zstd level (1 fast .. 19 small); at 1, Arrow's default, photos read 1.25-1.4x faster
            than at zstd's own default 3 for 0.5-3.5 % more bytes (encoder outputs: 2.5 % more).
        min_savings: A sample is stored uncompressed when zstd saves less than this share of its bytes
            (photos' pixels often: reading them is then a copy instead of a decompression).
        pixel_layout: How pixels are stored: row_tree (differences of rows along a binary tree: photos 1.1-1.3x
            smaller than gzip stores them, read 3-4x as fast as gzip's), rows (each row minus the one above: 1.3-1.6x
            smaller than gzip's, the loader reads them at 0.8x row_tree's rate) or plain (as they are: about
            gzip's size, a copy to read).
        shard_size_mb: Target size of one shard file in MB (many samples per file; at most 4000).
        threads: Read cached batches with data.num_workers threads of the training process instead of worker
            processes (no copy through shared memory); not while mode ondemand still decodes images.
    """

    dir: str | None = None
    mode: Literal["read", "build", "ondemand", "off"] = "build"
    pixels: bool = True
    encoder: dict | None = None
    encoder_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    encoder_key: str = "latent"
    caption_encoder: dict | None = None
    caption_key: str = "caption_embedding"
    encoder_batch_size: int | None = None
    compression: Literal["zstd", "none"] = "zstd"
    compression_level: int = 1
    min_savings: float = 0.1
    pixel_layout: Literal["row_tree", "rows", "plain"] = "row_tree"
    shard_size_mb: int = 256
    threads: bool = True

    def __post_init__(self):
        self.dir = given_dir(self.dir)

    def problems(self) -> list[str]:
        out = []
        if self.mode not in MODES:
            out.append(f"data.cache.mode = {self.mode!r}: must be one of {', '.join(MODES)}")
        if not self.dir and (self.mode in ("read", "ondemand") or self.encoder or self.caption_encoder):
            out.append("data.cache.dir is not set: name the cache folder (a local path or s3://bucket/prefix), "
                       "or set data.cache.mode: off")
        if self.dir and self.mode != "off" and not self.fields():
            out.append("data.cache caches nothing: set data.cache.pixels: true, data.cache.encoder and/or "
                       "data.cache.caption_encoder")
        for name in ("encoder", "caption_encoder"):
            spec = getattr(self, name)
            if spec is not None and not (isinstance(spec, dict) and isinstance(spec.get("class_path"), str)):
                out.append(f"data.cache.{name} = {spec!r}: give it as {{class_path: my.Module, init_args: {{...}}}}")
        if self.caption_encoder is not None and self.mode == "ondemand":
            out.append("data.cache.caption_encoder is built before training, not on demand: use data.cache.mode build "
                       "(or read after `lit-dist cache`)")
        if self.encoder_dtype not in DTYPES:
            out.append(f"data.cache.encoder_dtype = {self.encoder_dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.compute_dtype not in ("auto", *DTYPES):
            out.append(f"data.cache.compute_dtype = {self.compute_dtype!r}: must be auto or one of {', '.join(DTYPES)}")
        if self.pixel_layout not in PIXEL_LAYOUTS:
            out.append(f"data.cache.pixel_layout = {self.pixel_layout!r}: must be one of {', '.join(PIXEL_LAYOUTS)}")
        if self.compression not in ("zstd", "none"):
            out.append(f"data.cache.compression = {self.compression!r}: must be zstd or none")
        if self.compression == "zstd" and not 1 <= self.compression_level <= 22:
            out.append(f"data.cache.compression_level = {self.compression_level}: zstd levels are 1..22")
        if not 0 <= self.min_savings < 1:
            out.append(f"data.cache.min_savings = {self.min_savings}: must be in [0, 1)")
        if not 1 <= self.shard_size_mb <= 4000:
            out.append(f"data.cache.shard_size_mb = {self.shard_size_mb}: must be in 1..4000 (offsets are 32-bit)")
        if self.encoder_batch_size is not None and self.encoder_batch_size < 1:
            out.append(f"data.cache.encoder_batch_size = {self.encoder_batch_size}: must be >= 1")
        return out

    @property
    def compute(self) -> str:
        """The dtype the encoders run in (auto, where pipeline.path has not resolved it: fp32)."""
        return "fp32" if self.compute_dtype == "auto" else self.compute_dtype

    @property
    def enabled(self) -> bool:
        """A cache is used once it has a folder, unless mode is off."""
        return self.mode != "off" and bool(self.dir)

    def fields(self) -> list[str]:
        """The cached fields, in a fixed order."""
        return [f for f, on in (("pixels", self.pixels), ("encoder", self.encoder is not None),
                                ("caption_encoder", self.caption_encoder is not None)) if on]


def given_dir(value: str | None) -> str | None:
    """``data.cache.dir`` as meant: jsonargparse hands ``--data.cache.dir null`` on a command line (a field of a
    dataclass inside the data module's init_args) over as the string "None", which would be a cache folder ./None."""
    return None if value in ("None", "null", "") else value
