"""Networks for tests, named in YAML as ``tests.helpers.nets.<Name>``."""

from torch import nn

from lit_dist.model.nets import SimpleCNN


class DropoutCNN(nn.Module):
    """SimpleCNN with dropout on its logits: every training step draws from the global torch RNG."""

    def __init__(self, num_classes: int = 4, p: float = 0.3):
        super().__init__()
        self.body = SimpleCNN(num_classes=num_classes)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return self.dropout(self.body(x))


class WideHeadCNN(nn.Module):
    """SimpleCNN with a wide square layer on top: a few million parameters, so that saves take a while."""

    def __init__(self, num_classes: int = 4, width: int = 1536):
        super().__init__()
        self.body = SimpleCNN(num_classes=num_classes)
        self.head = nn.Sequential(nn.Linear(num_classes, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                  nn.Linear(width, num_classes))

    def forward(self, x):
        return self.head(self.body(x))
