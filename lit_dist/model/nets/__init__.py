"""Small reference networks. Any ``torch.nn.Module`` can be named in the YAML instead."""

from lit_dist.model.nets.cnn import ConvStage, SimpleCNN
from lit_dist.model.nets.denoiser import TinyUNet
from lit_dist.model.nets.encoded import EncodedNet

__all__ = ["ConvStage", "EncodedNet", "SimpleCNN", "TinyUNet"]
