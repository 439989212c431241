"""What a checkpoint holds beyond Lightning's own state: every rank's random streams, and loop
counters Lightning resumes correctly; and which strategies let rank 0 write the whole checkpoint."""

import numpy as np
import torch


def rank_zero_writes(strategy) -> bool:
    """Whether rank 0 writes the whole checkpoint (else every rank writes a part)."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    if "deepspeed" in type(strategy).__name__.lower():
        return False
    if isinstance(strategy, ModelParallelStrategy):
        return not strategy._save_distributed_checkpoint
    if isinstance(strategy, FSDPStrategy):
        return strategy._state_dict_type == "full"
    return isinstance(strategy, (DDPStrategy, SingleDeviceStrategy))


def as_next_epoch_start(fit_loop: dict) -> None:
    """Turn Lightning's loop counters, saved after the last batch of an epoch, into those of the next epoch's start.

    Lightning 2.6 restores a checkpoint taken after an epoch's last batch (or in on_train_epoch_end)
    as a restart inside that epoch and, depending on the data loader, counts the epoch twice: the
    resumed run trains one epoch less. The weights, optimizer and step count are the same at the
    start of the next epoch, and that state Lightning resumes as a plain start.
    """
    for part in fit_loop["epoch_progress"].values():
        part.update(dict.fromkeys(part, part["ready"]))  # this epoch ready, started, processed, completed
    per_epoch = [fit_loop["epoch_loop.batch_progress"], fit_loop["epoch_loop.scheduler_progress"],
                 fit_loop["epoch_loop.manual_optimization.optim_step_progress"],
                 *fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"].values()]
    for progress in per_epoch:
        progress["current"] = dict.fromkeys(progress["current"], 0)
    batches = fit_loop["epoch_loop.batch_progress"]
    batches["total"]["completed"] = batches["total"]["processed"]  # the last batch counts as completed
    batches["is_last_batch"] = False


def rng_state() -> dict:
    """This process's random streams, in types that ``torch.load(weights_only=True)`` accepts."""
    import random

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
