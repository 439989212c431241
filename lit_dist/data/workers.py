"""How worker processes start: fork where the interpreter forks safely, a fork server where it can deadlock.

Python 3.10 before 3.10.15 and 3.11 before 3.11.10 (CPython gh-112275; 3.12 has its own fix): a
process forked while another thread of its parent is creating a Python thread state inherits the
interpreter's thread-list lock held, and waits for it forever inside ``os.fork``. PyTorch's collective
threads (gloo's run loop, NCCL's watchdog) create one every time they drop a tensor that has a Python
object, which is just when a collective completes. A DataLoader that forks its workers right after a
collective (Lightning's sanity check, the start of training) then hangs in its first ``next()``:
measured here, one 2-process DDP start in about ten on 2 cores (the child's native stack:
``PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept -> PyThread_acquire_lock``).

``forkserver`` sidesteps it: the training process starts one server process with fork-and-exec (no
Python runs between the two), and every worker is forked from that single-threaded server. The cost:
each worker receives its dataset by pickle (a split's rows, not the whole table: see
``BucketImageDataset.__getstate__``) instead of sharing the parent's memory, and the server imports
what workers need once per rank (torch, Lightning, lit-dist: about 3 s of CPU), started when the data
module is made so that it overlaps the model's construction and the process group's start. As with
any start method but fork, a script that calls ``fit`` itself needs ``if __name__ == "__main__":``
(``lit-dist fit`` has it).
"""

import multiprocessing
import sys
from typing import Literal

Start = Literal["auto", "fork", "forkserver", "spawn"]
START_METHODS = ("auto", "fork", "forkserver", "spawn")

# Modules every worker needs, imported once by the fork server instead of once per worker: Lightning's
# worker seeding function, and lit_dist.cli because each worker re-runs the `lit-dist` script (its
# __main__), which would otherwise import Lightning's CLI in every worker.
_PRELOAD = ["torch", "lightning.fabric.utilities.seed", "lit_dist.cli", "lit_dist.data.dataset", "lit_dist.cache.build"]


def fork_is_safe(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this Python forks a multi-threaded process without the gh-112275 deadlock."""
    if version[:2] == (3, 10):
        return version >= (3, 10, 15)
    if version[:2] == (3, 11):
        return version >= (3, 11, 10)
    return version >= (3, 12)


def method(start: Start = "auto") -> str:
    """The start method ``start`` means on this machine: auto is fork where it is safe, else forkserver."""
    if start == "auto":
        return "fork" if fork_is_safe() else "forkserver"
    return start


def context(start: Start = "auto") -> multiprocessing.context.BaseContext:
    """A multiprocessing context for worker processes (DataLoader workers, process pools)."""
    chosen = method(start)
    ctx = multiprocessing.get_context(chosen)
    if chosen == "forkserver":
        # Only takes effect before this process's server starts; later calls change nothing.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_early(start: Start = "auto") -> None:
    """Start this process's fork server now (if workers will use one): its imports then overlap other work."""
    if method(start) == "forkserver":
        from multiprocessing import forkserver

        context(start)  # sets the preload list before the server starts
        forkserver.ensure_running()
