"""``lit-dist export CKPT --output model.pt``: any checkpoint's network as a plain full-precision state_dict.

    lit-dist export runs/my-run/slurm-123/checkpoints/step-000004000 --output model.pt
    lit-dist export runs/my-run/slurm-123/checkpoints --output model.pt    # the newest usable one
    lit-dist export downloaded.ckpt --output model.pt --trust_pickle       # a file you trust that holds other types
    lit-dist export runs/my-run/slurm-123/checkpoints --ema true --output model-ema.pt   # the weight average

    net = MyNet(...)
    net.load_state_dict(torch.load("model.pt", weights_only=True))
"""

import os

from lit_dist.ckpt.export import load_checkpoint_state, network_state, save_atomically, to_full_precision
from lit_dist.errors import DataError


def export(checkpoint: str, output: str = "model.pt", ema: bool = False, trust_pickle: bool = False) -> None:
    """Write the wrapped network of a checkpoint as a plain full-precision state_dict.

    Args:
        checkpoint: A checkpoint file (.ckpt) or folder (FSDP sharded, DeepSpeed ZeRO) written by lit-dist or Lightning.
        output: Where to write the state_dict (torch.save); load it with torch.load(output, weights_only=True).
        ema: Write the network with its weight average (model.ema) in place of the trained weights.
        trust_pickle: Unpickle whatever types the checkpoint names (unpickling can run any code): only for a file
            you trust. Without it, a checkpoint holding a type beyond lit-dist's own is refused (exit code 3).
    """
    if not os.path.exists(checkpoint):
        raise DataError(f"checkpoint {checkpoint!r} does not exist")
    state = to_full_precision(network_state(load_checkpoint_state(checkpoint, trust_pickle), ema))
    save_atomically(state, output)
    count = sum(v.numel() for v in state.values())
    print(f"lit-dist export: {len(state)} tensors ({count:,} values) from {checkpoint} -> {output}")
