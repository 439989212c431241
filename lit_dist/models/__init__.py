"""Small reference networks. Any ``torch.nn.Module`` can be named in the YAML instead."""

from lit_dist.models.cnn import ConvStage, SimpleCNN
from lit_dist.models.denoiser import TinyUNet
from lit_dist.models.encoded import EncodedNet

__all__ = ["ConvStage", "EncodedNet", "SimpleCNN", "TinyUNet"]
