"""Small collectives at step boundaries: how ranks agree without one of them deciding alone.

Each is a no-op on a single process, and each must be called by every rank at the same point:
a collective that only some ranks reach hangs the others.
"""

import torch


def agree_any(trainer, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank: one small all-reduce (none on a single process)."""
    if trainer.world_size == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(tensor, reduce_op="max")) > 0


def all_gather_object(trainer, obj) -> list:
    if trainer.world_size == 1:
        return [obj]
    gathered = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def run_on_every_rank(trainer, function):
    """Start the run's processes the way ``fit`` would (srun, torchrun, or Lightning's own launcher for
    ``--trainer.devices N``), join the process group, and call ``function()`` on every rank.

    For work that is not a Lightning loop (building a cache) but must be spread over the same ranks.
    """
    strategy = trainer.strategy

    def on_rank():
        strategy.setup_environment()  # device, and the process group for multi-process strategies
        return function()

    launcher = strategy.launcher
    return launcher.launch(on_rank, trainer=trainer) if launcher is not None else on_rank()
