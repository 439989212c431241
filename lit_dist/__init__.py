"""lit-dist: PyTorch Lightning training driven by one YAML file.

Imports stay lazy on purpose: ``lit-dist`` starts faster when only the pieces a
run needs are loaded (DeepSpeed, pyarrow and Pillow are imported on use).
"""

import os

# pyarrow's jemalloc starts a background thread when pyarrow is imported; a process forked while that
# thread holds one of jemalloc's locks can deadlock. Loader workers are forked (by the training process,
# or by the single-threaded fork server that lit_dist.reading.workers uses where fork is unsafe for another
# reason), so the thread is off. It must be set before pyarrow is first imported; a user's own setting stays.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")

__version__ = "0.1.0"

__all__ = ["LitModel", "BucketDataModule", "__version__"]


def __getattr__(name: str):
    if name == "LitModel":
        from lit_dist.model.module import LitModel

        return LitModel
    if name == "BucketDataModule":
        from lit_dist.data.datamodule import BucketDataModule

        return BucketDataModule
    raise AttributeError(f"module 'lit_dist' has no attribute {name!r}")
