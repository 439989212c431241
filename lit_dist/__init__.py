"""lit-dist: PyTorch Lightning training driven by one YAML file.

Imports stay lazy on purpose: ``lit-dist`` starts faster when only the pieces a
run needs are loaded (DeepSpeed, pyarrow and Pillow are imported on use).
"""

__version__ = "0.1.0"

__all__ = ["LitModel", "BucketDataModule", "__version__"]


def __getattr__(name: str):
    if name == "LitModel":
        from lit_dist.module import LitModel

        return LitModel
    if name == "BucketDataModule":
        from lit_dist.data.datamodule import BucketDataModule

        return BucketDataModule
    raise AttributeError(f"module 'lit_dist' has no attribute {name!r}")
