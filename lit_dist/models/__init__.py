"""Small reference networks. Any ``torch.nn.Module`` can be named in the YAML instead."""

from lit_dist.models.cnn import SimpleCNN

__all__ = ["SimpleCNN"]
