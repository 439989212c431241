"""Callbacks the tests add to real `lit-dist fit` runs (`--trainer.callbacks+=tests.helpers.recorder.LossRecorder`)."""

import json
import os

from lightning.pytorch import Callback


def write_rank_json(trainer, name: str, value) -> None:
    """``value`` as ``{run dir}/{name}-rank{N}.json`` for this rank."""
    run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"{name}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump(value, f)


class LossRecorder(Callback):
    """Writes every training step's loss of this rank to ``{run dir}/losses-rank{N}.json`` at the end."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "losses", self.losses)


class RandomStreams(Callback):
    """Writes a digest of this rank's torch random state at the start of every training step to
    ``{run dir}/streams-rank{N}.json`` at the end (the state the objective's noise and timesteps come from)."""

    def __init__(self):
        self.digests = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import hashlib

        import torch

        self.digests.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16])

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "streams", self.digests)


class StopAtStep(Callback):
    """Stops training after optimizer step ``step`` on every rank, as a preempted run would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class FailSaveOnRank(Callback):
    """Rank ``rank``'s part of every checkpoint save raises ``OSError`` inside the strategy's own save, the others'
    succeed: what a node whose disk (or mount) went bad does to a sharded save."""

    def __init__(self, rank: int = 1):
        self.rank = rank

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank != self.rank:
            return
        strategy = trainer.strategy
        real = strategy.save_checkpoint

        def failing(checkpoint, filepath, *args, **kwargs):
            real(checkpoint, filepath, *args, **kwargs)  # the strategy's collectives run on every rank alike
            raise OSError(f"injected: rank {self.rank} could not write its part of {filepath}")

        strategy.save_checkpoint = failing


class SignalAtStep(Callback):
    """Sends ``signal`` to this process after optimizer step ``step``, as Slurm or Kubernetes would."""

    def __init__(self, step: int, signal: str = "SIGUSR1"):
        self.step, self.signal = step, signal

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal))


class WeightsDigest(Callback):
    """Writes ``{run dir}/weights-rank{N}.json`` at the end: this rank's host and a sha256 of its weights."""

    def on_train_end(self, trainer, pl_module):
        import hashlib
        import socket

        digest = hashlib.sha256()
        for name, tensor in sorted(pl_module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        write_rank_json(trainer, "weights", {"host": socket.gethostname(), "rank": trainer.global_rank,
                                             "node_rank": trainer.node_rank, "sha256": digest.hexdigest()})


class StopAfterEpoch(Callback):
    """Stops training when epoch ``epoch`` ends, as early stopping does."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch >= self.epoch:
            trainer.should_stop = True


class RowRecorder(Callback):
    """Keeps, for every training batch of this rank, ``(epoch, metadata rows of its samples)``; at the end
    also writes them to ``{run dir}/{tag}-rank{N}.json``."""

    def __init__(self, tag: str = "rows"):
        self.tag = tag
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch["row"].tolist()))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, self.tag, self.batches)


class GatheredDtype(Callback):
    """Writes the dtypes an FSDP2 block's parameters have inside its forward (gathered) to ``{run dir}/gathered-rank{N}.json``."""

    def on_train_start(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule

        self.dtypes = set()
        block = next(m for m in pl_module.net.modules() if isinstance(m, FSDPModule) and m is not pl_module.net)
        # Registered after fully_shard's own pre-forward hook, so it runs once the block is gathered.
        block.register_forward_pre_hook(lambda module, args: self.dtypes.update(str(p.dtype) for p in module.parameters()))

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "gathered", sorted(self.dtypes))


class StopStep(Callback):
    """Writes ``{run dir}/stop-rank{N}.json`` when the run ends with an exception: the step and the error."""

    def on_exception(self, trainer, pl_module, exception):
        write_rank_json(trainer, "stop", {"step": trainer.global_step, "error": type(exception).__name__})


class SignalRankAtStep(Callback):
    """Sends SIGUSR1 to the process of rank ``rank`` only, after optimizer step ``step``."""

    def __init__(self, step: int, rank: int = 1):
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import signal

        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGUSR1)


class BlockRankAtStep(Callback):
    """Blocks rank ``rank`` for ``seconds`` at the start of the step after ``step`` (a stuck loader or device)."""

    def __init__(self, step: int, rank: int = 1, seconds: float = 600.0):
        self.step, self.rank, self.seconds = step, rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import time

        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            time.sleep(self.seconds)  # the frame the hang dump must show


class KillAtStep(Callback):
    """SIGKILLs this process (no handler, no save: a node failure) once ``step`` optimizer steps are done."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "monitored_barrier")


def called_by_lit_dist(stack) -> bool:
    """Whether the innermost caller outside torch and Lightning is lit-dist code (its command line, which
    runs all of Lightning's loop, does not count)."""
    for frame in reversed(stack[:-2]):  # innermost first, past this helper's wrapper
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" in path or "/lightning/" in path:
            continue
        return "/lit_dist/" in path and not path.endswith("/lit_dist/cli/app.py")
    return False


class CollectiveCounter(Callback):
    """Counts the ``torch.distributed`` collectives that lit-dist's own code calls (``called_by_lit_dist``)
    between consecutive training batches; writes ``{run dir}/collectives-rank{N}.json``:
    one ``[step, count, clean]`` per batch, ``clean`` false when an epoch boundary or a validation fell in
    the interval (those have collectives of their own: saves, evaluation sums)."""

    def setup(self, trainer, pl_module, stage):
        import torch.distributed as dist

        self.count, self.clean, self.rows = 0, True, []

        def counted(function):
            def wrapper(*args, **kwargs):
                import traceback

                if called_by_lit_dist(traceback.extract_stack()):
                    self.count += 1
                return function(*args, **kwargs)
            return wrapper

        for name in COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, counted(getattr(dist, name)))

    def on_train_epoch_start(self, trainer, pl_module):
        self.clean = False

    def on_validation_start(self, trainer, pl_module):
        self.clean = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append([trainer.global_step, self.count, self.clean])
        self.count, self.clean = 0, True

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "collectives", self.rows)


class SyncWatch(Callback):
    """From optimizer step ``after`` on, runs under ``torch.cuda.set_sync_debug_mode("warn")`` and writes the
    host-device synchronisations that lit-dist's own code (``called_by_lit_dist``, its model wrapper aside)
    caused to ``{run dir}/syncs-rank{N}.json``: one ``[step, file:line]`` each."""

    def __init__(self, after: int = 10):
        self.after, self.syncs, self.active = after, [], False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import traceback
        import warnings

        import torch

        if self.active or trainer.global_step < self.after:
            return
        self.active = True
        previous = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            stack = traceback.extract_stack()
            if "synchronizing" in str(message) and called_by_lit_dist(stack):
                frame = next(f for f in reversed(stack[:-1]) if "/lit_dist/" in f.filename.replace(os.sep, "/"))
                if not frame.filename.endswith("module.py"):
                    self.syncs.append([trainer.global_step, f"{frame.filename}:{frame.lineno}"])
            return previous(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer, pl_module):
        import torch

        torch.cuda.set_sync_debug_mode("default")
        write_rank_json(trainer, "syncs", self.syncs)


class SleepInStep(Callback):
    """Sleeps ``seconds`` in every training step before the backward; on rank ``rank`` ``factor`` times as long:
    a rank made that much slower in its own work, the others equal."""

    def __init__(self, seconds: float, rank: int = -1, factor: float = 1.0):
        self.seconds, self.rank, self.factor = seconds, rank, factor

    def on_before_backward(self, trainer, pl_module, loss):
        import time

        time.sleep(self.seconds * (self.factor if trainer.global_rank == self.rank else 1.0))


class KillRankAtStep(Callback):
    """Rank ``rank`` SIGKILLs itself (``what: rank``, as the out-of-memory killer would) or one of its data loader
    workers (``what: worker``) at the start of the step after optimizer step ``step``."""

    def __init__(self, step: int, rank: int = 1, what: str = "rank"):
        self.step, self.rank, self.what = step, rank, what

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import gc
        import signal

        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.what == "rank":
            os.kill(os.getpid(), signal.SIGKILL)
        # The training loader's: the validation loader's (persistent) workers would be missed only at the next
        # validation, an epoch later.
        train = trainer.train_dataloader.dataset
        loaders = [o for o in gc.get_objects()
                   if isinstance(o, _MultiProcessingDataLoaderIter) and o._workers and o._dataset is train]
        os.kill(loaders[0]._workers[0].pid, signal.SIGKILL)


class HoldGilAtStep(Callback):
    """Rank ``rank`` sleeps ``seconds`` in C without releasing the interpreter lock at the start of the step after
    ``step`` (``step: -1``: in ``on_train_start``, before its first step), as a rank stuck in a C extension's
    loop: no other thread of it runs, and no Python signal handler."""

    def __init__(self, step: int, rank: int = 1, seconds: int = 600):
        self.step, self.rank, self.seconds = step, rank, seconds

    def _hold(self, trainer):
        import ctypes

        if trainer.global_rank == self.rank:
            ctypes.PyDLL(None).sleep(self.seconds)  # PyDLL: the call keeps the GIL

    def on_train_start(self, trainer, pl_module):
        if self.step < 0:
            self._hold(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self._hold(trainer)


class RaiseDataErrorAtStep(Callback):
    """Rank ``rank`` raises lit-dist's DataError (exit 3) at the start of the step after ``step``; the others go on
    into that step's collective."""

    def __init__(self, step: int, rank: int = 1):
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lit_dist.errors import DataError

        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise DataError("a data error raised by the test on one rank")


class MarkAtStep(Callback):
    """Creates the file ``path`` once optimizer step ``step`` is done (rank 0), for a test that acts from outside
    at that moment."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            open(self.path, "w").close()


class PredictAtEnd(Callback):
    """Writes the network's outputs for a fixed input to ``{run dir}/predictions-rank{N}.json`` when training ends,
    with the strategy's own model (under ZeRO-3 each forward gathers the partitioned parameters: every rank runs it).

    With model.ema, also ``predictions-ema`` (the average swapped in, then out again) at the end, and
    ``swap-rank{N}.json`` after optimizer step ``swap_step``: the outputs with the average swapped in, then with the
    raw weights back ({"ema": ..., "raw": ...}). Mid-run, ZeRO-3 keeps its small parameters gathered between steps,
    which a swap into the partitions alone would not reach."""

    def __init__(self, swap_step: int = 0):
        self.swap_step = swap_step

    @staticmethod
    def _outputs(pl_module, swapped: bool = False) -> list:
        import torch

        x = torch.randn(3, 3, 24, 40, generator=torch.Generator().manual_seed(0)).to(pl_module.device)
        pl_module.eval()
        if swapped:
            pl_module.ema.swap_in()
        with torch.no_grad():
            out = pl_module.net(x).float().cpu().tolist()
        if swapped:
            pl_module.ema.swap_out()
        pl_module.train()
        return out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.swap_step and pl_module.ema is not None:
            write_rank_json(trainer, "swap", {"ema": self._outputs(pl_module, swapped=True),
                                              "raw": self._outputs(pl_module)})

    def on_train_end(self, trainer, pl_module):
        write_rank_json(trainer, "predictions", self._outputs(pl_module))
        if pl_module.ema is not None and pl_module.ema.started(trainer.global_step):
            write_rank_json(trainer, "predictions-ema", self._outputs(pl_module, swapped=True))


class EMAPlacement(Callback):
    """Writes ``{run dir}/ema-rank{N}.json``: the values of model.ema's average this rank holds (local shards) and
    the network's trainable values in all, and whether DDP broadcasts any of the average's buffers."""

    def on_train_end(self, trainer, pl_module):
        ema = pl_module.ema
        buffers = [ema.average.get_buffer(name) for name in ema.names]
        local = sum((b.to_local() if hasattr(b, "to_local") else b).numel() for b in buffers)
        full = sum(p.numel() for p in pl_module.net.parameters() if p.requires_grad)
        broadcast = getattr(trainer.strategy.model, "modules_buffers", [])
        ours = {b.data_ptr() for b in buffers}
        from lit_dist.model.ema import _local

        write_rank_json(trainer, "ema", {"local": local, "full": full,
                                         "broadcast": any(b.data_ptr() in ours for b in broadcast),
                                         "devices": sorted({str(_local(b).device) for b in buffers}),
                                         "weight_devices": sorted({str(_local(p).device) for p in ema._params})})


class WeightsAtStart(Callback):
    """At the start of training (after a resume has loaded its checkpoint), writes the whole network, gathered
    from every rank's shards where sharded, to ``{run dir}/weights-at-start.pt`` (rank 0). A collective under
    FSDP2: every rank gathers."""

    def on_train_start(self, trainer, pl_module):
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(pl_module.net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
            torch.save(state, os.path.join(run_dir, "weights-at-start.pt"))


class EpochSize(Callback):
    """Writes the number of samples the sampler plans for an epoch at this world size to ``{run dir}/epoch-size-rank{N}.json``."""

    def on_train_start(self, trainer, pl_module):
        sampler = trainer.datamodule.train_sampler(trainer.world_size, trainer.global_rank)
        write_rank_json(trainer, "epoch-size", len(sampler) * sampler.global_batch_size)


class StallReadsAtStep(Callback):
    """At the end of optimizer step ``step``: waits ``settle_s`` for the loader workers to finish the batches in
    flight, then makes every image under ``folder`` a FIFO that nobody writes to. A worker's next read blocks for
    ever (a read stuck in the kernel, a hung network mount), while the batches already made still arrive."""

    def __init__(self, step: int, folder: str, settle_s: float = 1.0):
        self.step, self.folder, self.settle_s = step, folder, settle_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import time
        from pathlib import Path

        if trainer.global_step != self.step:
            return
        time.sleep(self.settle_s)
        for image in Path(self.folder).rglob("*.png"):
            image.unlink()
            os.mkfifo(image)


class RaiseAtStep(Callback):
    """Raises ``error`` (a class of lit_dist.errors: ConfigError, DataError, ...) with ``message`` at the end of
    optimizer step ``step``, as a fault found late in a run would."""

    def __init__(self, step: int, error: str = "ConfigError", message: str = "injected"):
        self.step, self.error, self.message = step, error, message

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lit_dist import errors

        if trainer.global_step == self.step:
            raise getattr(errors, self.error)(self.message)


class AverageByHand(Callback):
    """Computes model.ema's average by hand from the weights after every optimizer step (whole tensors: DDP,
    ZeRO-1/2) with the average's own schedule; at the end writes ``{run dir}/by-hand-rank{N}.json`` (the largest
    difference from the run's average, the number of updates) and, on rank 0, both averages to ``average.pt``."""

    def __init__(self):
        self.expected, self._seen = None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._seen:
            return
        self._seen = step
        weight = pl_module.ema.weight(step)
        if weight is None:
            return
        now = [p.detach().double().clone() for p in pl_module.ema._params]
        self.expected = now if self.expected is None else [e + weight * (w - e) for e, w in
                                                           zip(self.expected, now, strict=True)]

    def on_train_end(self, trainer, pl_module):
        import torch

        ema = pl_module.ema
        got = [ema.average.get_buffer(name).double() for name in ema.names]
        worst = max(float((g - e).abs().max()) for g, e in zip(got, self.expected, strict=True))
        write_rank_json(trainer, "by-hand", {"worst": worst, "updates": ema.count()})
        if trainer.is_global_zero:
            run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
            torch.save({name: g.float() for name, g in zip(ema.names, got, strict=True)},
                       os.path.join(run_dir, "average.pt"))


class WhoAmI(Callback):
    """Writes ``{run dir}/who-rank{N}.json`` at the start of training: this rank's pid, parent, command line,
    Lightning's idea of its rank (``rank_zero_only.rank``) and its process's start time."""

    def on_train_start(self, trainer, pl_module):
        import psutil
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        me = psutil.Process()
        write_rank_json(trainer, "who", {"pid": me.pid, "ppid": me.ppid(), "cmdline": me.cmdline(),
                                         "rank_zero_only": rank_zero_only.rank, "started": me.create_time()})
