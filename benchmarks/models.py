"""Networks used only by the benchmarks."""

from torch import nn


class MLPBlock(nn.Module):
    """Linear + GELU with a residual: the unit FSDP2 shards in the memory benchmark."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MLPClassifier(nn.Module):
    """Flattened image -> width -> depth residual MLP blocks -> classes; ~56 M parameters by default."""

    def __init__(self, in_features: int = 3 * 32 * 32, width: int = 2048, depth: int = 12, num_classes: int = 4):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*(MLPBlock(width) for _ in range(depth)))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x.flatten(1))))  # (B, num_classes)
