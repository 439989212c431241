"""Small collectives at step boundaries: how ranks agree without one of them deciding alone; and
``Comm``, for work split among ranks outside a step (a folder scan, ``lit-dist index`` under srun).

Each is a no-op on a single process, and each must be called by every rank at the same point:
a collective that only some ranks reach hangs the others.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch

from lit_dist.runtime.launch import launcher_environment  # it lives with the rest of the launch layout


def agree_any(trainer, flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank: one small all-reduce (none on a single process)."""
    if trainer.world_size == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(tensor, reduce_op="max")) > 0


def all_gather_object(trainer, obj) -> list:
    """Every rank's ``obj`` of the trainer's run, in rank order, on every rank."""
    return Comm(trainer.global_rank, trainer.world_size).all_gather(obj)


def run_on_every_rank(trainer, function):
    """Start the run's processes the way ``fit`` would (srun, torchrun, or Lightning's own launcher for
    ``--trainer.devices N``), join the process group, and call ``function()`` on every rank.

    For work that is not a Lightning loop (building a cache) but must be spread over the same ranks.
    """
    strategy = trainer.strategy

    def on_rank():
        strategy.setup_environment()  # device, and the process group for multi-process strategies
        with _group_left_at_end():
            return function()

    launcher = strategy.launcher
    return launcher.launch(on_rank, trainer=trainer) if launcher is not None else on_rank()


class Comm:
    """Object collectives over the default process group, for work split among ranks outside a training
    step (a folder scan); on one process every call is trivial.

    torch.distributed has the collectives. What it lacks, added here: an exception on one rank reaches
    every rank (``on_rank_zero``, ``on_every_rank``), so no rank is left waiting for one that gave up.
    Every method is a collective: every rank calls it, in the same order.
    """

    def __init__(self, rank: int = 0, world: int = 1, group=None):
        self.rank, self.world = rank, world
        self.group = group  # a process group of every rank; None: the default one

    @classmethod
    def current(cls) -> "Comm":
        """The default process group when one of several processes exists, else a one-process Comm."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier(group=self.group)

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        gathered = [None] * self.world
        torch.distributed.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (what the others pass is ignored)."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def on_rank_zero(self, function, what: str):
        """``function()`` run on rank 0, its result returned on every rank; if it raises, every rank raises."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = function()
            except Exception as exc:  # noqa: BLE001 - nothing swallowed: sent to the other ranks, then raised here
                error = exc
        result, described = self.broadcast((result, _describe(error)))
        if error is not None:
            raise error
        if described is not None:
            raise _raised_elsewhere(0, described, what)
        return result

    def on_every_rank(self, function, what: str) -> list:
        """``function()`` run on every rank, the list of all results (rank order) on every rank; if it raises
        on any rank, every rank raises."""
        result, error = None, None
        try:
            result = function()
        except Exception as exc:  # noqa: BLE001 - nothing swallowed: sent to the other ranks, then raised here
            error = exc
        return self.gather_or_raise(result, error, what)

    def gather_or_raise(self, obj, error: Exception | None, what: str) -> list:
        """Every rank's ``obj`` (rank order) once every rank has said how ``what`` went on it: if it failed on any
        rank (``error``: this rank's exception, or None), every rank raises."""
        gathered = self.all_gather((obj, _describe(error)))
        if error is not None:
            raise error
        failed = [(rank, described) for rank, (_, described) in enumerate(gathered) if described is not None]
        if failed:
            raise _raised_elsewhere(*failed[0], what)
        return [r for r, _ in gathered]


def _describe(error: Exception | None) -> tuple[str, str, int | None] | None:
    """What the other ranks need to raise an equivalent error: (type, message, exit code of a user error)."""
    if error is None:
        return None
    from lit_dist.errors import LitDistError

    return type(error).__name__, str(error), int(error.exit_code) if isinstance(error, LitDistError) else None


def _raised_elsewhere(rank: int, described: tuple[str, str, int | None], what: str) -> Exception:
    """The error a rank raises when ``what`` failed on another rank: a user error keeps its exit code."""
    from lit_dist.errors import ExitCode, LitDistError

    kind, message, code = described
    text = f"{what} failed on rank {rank}: {message if code is not None else f'{kind}: {message}'}"
    if code is None:
        return RuntimeError(text)
    error = LitDistError(text)
    error.exit_code = ExitCode(code)
    return error


@contextmanager
def launched_group(timeout_s: float = 1800) -> Iterator[Comm]:
    """The processes that srun or torchrun started, joined in a gloo process group for the duration, as a
    Comm; a one-process Comm when this process runs alone. Lightning builds a process group only inside
    a Trainer, so a command without one (``lit-dist index``) joins its processes here."""
    env = launcher_environment()
    if env is None or env.world_size() == 1:
        yield Comm()
        return
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"tcp://{env.main_address}:{env.main_port}", rank=env.global_rank(),
                            world_size=env.world_size(), timeout=timedelta(seconds=timeout_s))
    with _group_left_at_end():
        yield Comm.current()


@contextmanager
def _group_left_at_end() -> Iterator[None]:
    """Every rank leaves the default process group itself at the end, after the others are done (a barrier) unless
    the body failed. Left to the interpreter's exit, gloo's threads are torn down during finalization and a rank can
    abort after all its work ("terminate called without an active exception", pytorch/pytorch#190489)."""
    finished = False
    try:
        yield
        finished = True
    finally:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            try:
                if finished:
                    Comm.current().barrier()  # no rank closes its connections while another still uses them
            finally:
                dist.destroy_process_group()
