"""Every place lit-dist touches Lightning's private state, in one module (tested with Lightning 2.6).

Lightning's public API has no way to do these few things; each function names what it relies on, and
``tests/unit/test_compat.py`` checks each against the installed Lightning, so an upgrade that changes one
fails there, and at run time with one clear message naming it, instead of somewhere deep in a run.

======================================  ==========================================================
function                                Lightning internal
======================================  ==========================================================
``dump_checkpoint``                     ``trainer._checkpoint_connector.dump_checkpoint``
``is_last_batch``                       ``fit_loop.epoch_loop.batch_progress.is_last_batch``
``optimizer_steps_now``                 ``fit_loop._should_accumulate``
``batches_done``                        ``fit_loop.epoch_loop.batch_progress.current.processed``
``next_epoch``                          ``fit_loop.epoch_progress.current.started``
``shift_batches_done``                  ``batch_progress.current`` (ready, started, processed, completed)
``as_next_epoch_start``                 the saved ``fit_loop`` state: its progress keys
``rank_zero_writes``                    ``ModelParallelStrategy._save_distributed_checkpoint``,
                                        ``FSDPStrategy._state_dict_type``
``set_data_parallel``                   ``ModelParallelStrategy._data_parallel_size`` and ``_tensor_parallel_size``
``collective_timeout_s``                ``strategy._timeout`` (DDP, FSDP, DeepSpeed, ModelParallel)
``collectives_issued``                  ``ProcessGroup._get_sequence_number_for_group`` (torch, not Lightning)
``observe_child_ranks``                 ``launchers.subprocess_script._launch_process_observer``
``launch_local_ranks_with``             ``launchers.subprocess_script.subprocess`` (its ``Popen``)
``plain_console``                       ``trainer.connectors.callback_connector._RICH_AVAILABLE``
======================================  ==========================================================
"""

from contextlib import contextmanager

from lit_dist.errors import LitDistError

TESTED = "2.6"


class LightningChanged(LitDistError):
    """The installed Lightning no longer has an internal lit-dist relies on."""


@contextmanager
def _internal(what: str):
    try:
        yield
    except (AttributeError, KeyError, TypeError) as exc:
        import lightning

        raise LightningChanged(
            f"lit-dist relies on Lightning's {what}, which Lightning {lightning.__version__} changed ({type(exc).__name__}: "
            f"{exc}); lit-dist is tested with Lightning {TESTED}.x: pip install 'lightning=={TESTED}.*', or update "
            "lit_dist/runtime/compat.py") from exc


def dump_checkpoint(trainer) -> dict:
    """Lightning's whole checkpoint dict of this moment (what ``trainer.save_checkpoint`` would write)."""
    with _internal("trainer._checkpoint_connector.dump_checkpoint"):
        connector = trainer._checkpoint_connector
    return connector.dump_checkpoint(weights_only=False)


def _batch_progress(trainer):
    with _internal("trainer.fit_loop.epoch_loop.batch_progress"):
        return trainer.fit_loop.epoch_loop.batch_progress


def is_last_batch(trainer) -> bool:
    """Whether the training batch just done is its epoch's last."""
    progress = _batch_progress(trainer)
    with _internal("batch_progress.is_last_batch"):
        return bool(progress.is_last_batch)


def optimizer_steps_now(trainer) -> bool:
    """Inside ``optimizer_step``: whether this call steps (Lightning then counts a global step) rather than only
    accumulating. A strategy that accumulates itself (DeepSpeed) has the hook called for every micro-batch."""
    with _internal("trainer.fit_loop._should_accumulate"):
        return not trainer.fit_loop._should_accumulate()


def batches_done(trainer) -> int:
    """Training batches of the current epoch processed so far (the one in its end hooks included)."""
    progress = _batch_progress(trainer)
    with _internal("batch_progress.current.processed"):
        return int(progress.current.processed)


def next_epoch(trainer) -> int:
    """The number of the next epoch to begin (also after Lightning closed the current one)."""
    with _internal("trainer.fit_loop.epoch_progress.current.started"):
        return int(trainer.fit_loop.epoch_progress.current.started)


def shift_batches_done(trainer, delta: int) -> None:
    """Move Lightning's count of the epoch's batches by ``delta`` (it ends an epoch when the count reaches
    the loader's length)."""
    progress = _batch_progress(trainer)
    with _internal("batch_progress.current.ready/started/processed/completed"):
        current = progress.current
        for name in ("ready", "started", "processed", "completed"):
            setattr(current, name, getattr(current, name) + delta)


def as_next_epoch_start(fit_loop: dict) -> None:
    """Turn Lightning's saved loop counters, taken after the last batch of an epoch, into those of the next
    epoch's start.

    Lightning 2.6 restores a checkpoint taken after an epoch's last batch (or in on_train_epoch_end)
    as a restart inside that epoch and, depending on the data loader, counts the epoch twice: the
    resumed run trains one epoch less. The weights, optimizer and step count are the same at the
    start of the next epoch, and that state Lightning resumes as a plain start.
    """
    with _internal("the saved fit_loop state (epoch_progress, epoch_loop.*_progress)"):
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
        with _internal("ModelParallelStrategy._save_distributed_checkpoint"):
            return not strategy._save_distributed_checkpoint
    if isinstance(strategy, FSDPStrategy):
        with _internal("FSDPStrategy._state_dict_type"):
            return strategy._state_dict_type == "full"
    return isinstance(strategy, (DDPStrategy, SingleDeviceStrategy))


def writes_dcp_shards(strategy) -> bool:
    """Whether the strategy saves FSDP2's sharded folder (ModelParallelStrategy with its distributed checkpoint),
    which lit-dist writes itself (lit_dist/ckpt/sharded.py) in the layout Lightning loads."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy):
        return False
    with _internal("ModelParallelStrategy._save_distributed_checkpoint"):
        return bool(strategy._save_distributed_checkpoint)


def set_data_parallel(strategy, size: int) -> None:
    """Make a ModelParallelStrategy purely data parallel over ``size`` devices (one mesh dimension)."""
    with _internal("ModelParallelStrategy._data_parallel_size / _tensor_parallel_size"):
        strategy._data_parallel_size  # noqa: B018 - fails here, not in Lightning's mesh code, if renamed
        strategy._tensor_parallel_size  # noqa: B018
    strategy._data_parallel_size = size
    strategy._tensor_parallel_size = 1


def collective_timeout_s(strategy) -> float:
    """Seconds a collective may wait before the process group gives up (its ``timeout``; 1800 by default)."""
    import datetime

    from lightning.pytorch.strategies import ParallelStrategy

    if not isinstance(strategy, ParallelStrategy):  # one device: no process group of its own
        return 1800.0
    with _internal("strategy._timeout"):
        timeout = strategy._timeout
        return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 1800.0


def collectives_issued() -> int:
    """How many collectives this rank has issued on the default process group (-1 without one): a rank that
    never joined the collective the others wait in has a smaller count."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return -1
    try:  # torch's private API, not Lightning's: unknown (-1) if it changes; the watchdog then goes by step
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return -1


def observe_child_ranks(start) -> None:
    """Have Lightning's launcher call ``start(procs)`` with the ranks it starts as children of this process,
    instead of starting its own observer (which SIGKILLs every rank, this one included, when a child ends with
    any non-zero code, so the job's exit code no longer says what happened)."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    with _internal("launchers.subprocess_script._launch_process_observer"):
        subprocess_script._launch_process_observer  # noqa: B018 - fails here, not at launch, if renamed
    subprocess_script._launch_process_observer = start


def launch_local_ranks_with(popen) -> None:
    """Have Lightning's launcher start the local ranks it starts with ``popen(command, env=..., cwd=...)`` in place
    of ``subprocess.Popen`` (lit_dist/runtime/warm_ranks.py); everything else of ``subprocess`` stays."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    with _internal("launchers.subprocess_script.subprocess.Popen"):
        real = subprocess_script.subprocess
        real.Popen  # noqa: B018 - fails here, not at launch, if Lightning no longer starts ranks so

    class _Subprocess:
        Popen = staticmethod(popen)

        def __getattr__(self, name):
            return getattr(real, name)

    subprocess_script.subprocess = _Subprocess()


def plain_console() -> None:
    """Lightning's default progress bar and model summary as without ``rich`` (TQDM, a plain table), whether or
    not ``rich`` is installed: Lightning picks the Rich ones whenever the package is importable, and it comes with
    many others (transformers via huggingface_hub and typer), so installing one of those would change the console
    lit-dist's lines are written into. A RichProgressBar or RichModelSummary named in trainer.callbacks still works."""
    from lightning.pytorch.trainer.connectors import callback_connector

    with _internal("trainer.connectors.callback_connector._RICH_AVAILABLE"):
        callback_connector._RICH_AVAILABLE  # noqa: B018 - fails here if renamed, not silently
    callback_connector._RICH_AVAILABLE = False
