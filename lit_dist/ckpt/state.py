"""What a checkpoint holds beyond Lightning's own state: every rank's random streams; and where a rank's streams
start when there is none to restore."""

import numpy as np
import torch


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


def start_rank_streams(rank: int) -> None:
    """Give rank ``rank`` random streams of its own, derived from the run's seed (rank 0 keeps the ones it has).

    Every rank is seeded alike (Lightning's ``seed_everything``), which is what makes them build the same initial
    model. Left so, they also draw the same noise, timesteps, caption dropout and dropout masks at every step: on
    256 ranks a global batch of 8,192 latents would see the 32 timesteps of one rank's batch, 256 times over.
    """
    import random

    if rank == 0:  # a one-process run, and rank 0 of any run, draws what it always drew
        return
    seed = (torch.initial_seed() * 1_000_003 + rank) % 2**32
    torch.manual_seed(seed)  # every CUDA device's generator too
    random.seed(seed)
    np.random.seed(seed)
