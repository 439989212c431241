"""``Checkpointing``: checkpoints that survive kills, rotate safely, live on disk or S3, and resume exactly.

Enabled in every run (the CLI's ``checkpoint`` group). It is a Lightning ``Checkpoint``, so
Lightning adds no ``ModelCheckpoint`` of its own and runs this callback after the others (it sees
their ``should_stop``). Layout of ``dirpath`` (default ``{run_dir}/checkpoints``)::

    step-000001200/state.ckpt      Lightning's checkpoint (a folder for sharded strategies)
    step-000001200/COMPLETE.json   the marker with the manifest (step, epoch, files, sizes, sha256)
    latest                         name of the newest complete checkpoint

This callback keeps the schedule (when to save), the checks before training and the random
states; ``lit_dist.ckpt.saver`` writes a checkpoint (rank 0 or every rank for sharded strategies,
the marker last: see ``lit_dist.ckpt.store``) and ``lit_dist.ckpt.resume`` chooses the one to
resume from (the same choice as ``lit-dist export``).
- Saves happen every ``every_n_steps`` optimizer steps, every ``every_n_epochs`` epochs, every
  ``every_n_minutes`` (a fact shared with the run control, since the ranks' clocks differ: all
  ranks save at the same step once any of them is due), after each validation when ``monitor``
  is set, at the end of ``fit`` (``save_last``) and when the run control asks (preemption, GPU
  faults): this callback is the run control's saver.
- Rotation runs after a save succeeded: it keeps the newest ``keep_last_n``, the best
  ``keep_best_k`` by ``monitor`` and always the checkpoint this run resumed from.
- ``async_save: true`` copies the state aside (a fraction of a second) and writes it on a thread
  (DDP, single devices, FSDP2: each rank its shards); the next save waits for it.
- Every RNG of every rank (torch, CUDA, numpy, Python) is saved and restored, with the model,
  optimizer, schedulers, loop counters and the data position, so a resumed run is the same run.
- ``ckpt_path: auto`` (the CLI default) resumes from the newest checkpoint whose files match its
  manifest; damaged ones are reported and skipped. With several ranks, each verifies its share of the
  files; a damaged one found that way is marked in its manifest and the run stops with one line
  (the next start passes over it), since Lightning holds the path to load by then.
- On an object store, every upload, listing, marker and deletion waits out an outage of the store
  for up to ``outage_deadline_s``; past it, every rank ends with exit 17 ("retry later") and one line
  naming what it was doing.

Events: ``checkpoint.saved`` through the run control's publisher (step, epoch, path, bytes, seconds).

Example::

    checkpoint:
      every_n_minutes: 30       # preemptible cluster
      keep_last_n: 3
      monitor: val/loss
      async_save: true
"""

import logging
import os
import socket
import time
import uuid
from typing import Literal, NamedTuple

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lit_dist.ckpt import resume
from lit_dist.ckpt.files import write_bytes_atomically
from lit_dist.ckpt.io import AtomicCheckpointIO
from lit_dist.ckpt.saver import Rotation, Saver, summary
from lit_dist.ckpt.state import rng_state, set_rng_state, start_rank_streams
from lit_dist.ckpt.store import MARKER, PROBE, STATE, CheckpointStore
from lit_dist.errors import CheckpointError, ConfigError
from lit_dist.runtime import compat
from lit_dist.runtime.control import Agreed, Event, RunControl
from lit_dist.runtime.distributed import all_gather_object
from lit_dist.runtime.outage import DEADLINE_S, StoreUnreachable
from lit_dist.runtime.processes import age_s
from lit_dist.runtime.run_dir import RUN_ID_ENV

log = logging.getLogger(__name__)


class _Seen(NamedTuple):
    """What one rank reports of the checkpoint folder at the start (``Checkpointing._check_shared``)."""

    rank: int
    host: str
    sees: bool  # it read the probe rank 0 wrote
    unwritable: str | None  # rank 0: why it could not write there
    url: str  # the folder this rank chose
    lost: str | None  # the object store stayed away


class Checkpointing(Checkpoint):
    """Atomic, rotated, verified checkpoints on a local/shared filesystem or an object store; exact resume."""

    def __init__(
        self,
        dirpath: str = "{run_dir}/checkpoints",
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        every_n_minutes: float | None = None,
        save_last: bool = True,
        keep_last_n: int = 3,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_best_k: int = 1,
        async_save: bool = False,
        verify_checksums: bool = True,
        storage_options: dict | None = None,
        outage_deadline_s: float = DEADLINE_S,
    ):
        """Checkpoint settings.

        Args:
            dirpath: Folder of the checkpoints: a path or an fsspec URL (s3://bucket/ckpt/{run_id}); {run_dir} and {run_id} are filled in.
            every_n_steps: Save every this many optimizer steps; null: not by steps.
            every_n_epochs: Save at the end of every this many epochs; null: not by epochs.
            every_n_minutes: Save when this many minutes passed since the last save (preemptible clusters); null: not by time.
            save_last: Save when fit ends.
            keep_last_n: Newest checkpoints kept by rotation (at least 2, so a damaged newest one has a fallback).
            monitor: Metric to rank checkpoints by (e.g. val/loss); with it, a checkpoint is saved after each validation.
            mode: 'min' or 'max': which values of monitor are better.
            keep_best_k: Best checkpoints by monitor kept on top of the newest keep_last_n.
            async_save: Write checkpoints on a background thread after a quick copy of the state (DDP, single device, FSDP2).
            verify_checksums: Check the files' sha256 against the manifest before resuming, not just their size (each rank its share).
            storage_options: fsspec options for a remote dirpath (endpoint_url, region...); credentials come from the environment.
            outage_deadline_s: Seconds to wait out an object store that does not answer (each upload, listing, deletion) before exit 17.
        """
        problems = []
        if keep_last_n < 2:
            problems.append(f"checkpoint.keep_last_n: {keep_last_n} must be at least 2 so that a damaged newest "
                            "checkpoint has a fallback; set keep_last_n: 2 or more")
        for field, value in (("every_n_steps", every_n_steps), ("every_n_epochs", every_n_epochs),
                             ("every_n_minutes", every_n_minutes)):
            if value is not None and value <= 0:
                problems.append(f"checkpoint.{field}: {value} must be positive; use null to turn it off")
        if mode not in ("min", "max"):
            problems.append(f"checkpoint.mode: {mode!r} must be 'min' or 'max'")
        if keep_best_k < 0:
            problems.append(f"checkpoint.keep_best_k: {keep_best_k} must be 0 or more")
        if outage_deadline_s <= 0:
            problems.append(f"checkpoint.outage_deadline_s: {outage_deadline_s} must be positive (seconds)")
        ConfigError.collect(problems)
        self.dirpath = dirpath
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.every_n_minutes = every_n_minutes
        self.save_last = save_last
        self.keep_last_n = keep_last_n
        self.monitor = monitor
        self.mode = mode
        self.keep_best_k = keep_best_k
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.storage_options = storage_options or {}
        self.outage_deadline_s = outage_deadline_s
        self.resumed_from: str | None = None  # never deleted by rotation
        self._store: CheckpointStore | None = None
        self._io = AtomicCheckpointIO(self.storage_options, outage_deadline_s)
        self._saver: Saver | None = None
        self._last_seen_step = -1
        self._rng: list | None = None
        self._control: RunControl | None = None
        self._chosen: resume.Choice | None = None  # what resolve_ckpt_path chose, with this rank's findings

    def __repr__(self) -> str:
        return f"Checkpointing(dirpath={self.dirpath!r})"

    def connect(self, control: RunControl) -> None:
        """Become the run control's saver; share whether a time-based save is due on this rank."""
        self._control = control
        control.set_saver(self)
        control.share("checkpoint.save_due", "max", lambda: 1.0 if self._time_due() else 0.0)
        # A background save that failed (a full disk) stops the run within an exchange, not at the next save: the
        # steps in between would write the run's other files onto the same full disk.
        control.share("checkpoint.save_failed", "max",
                      lambda: 1.0 if self._saver is not None and self._saver.failed_in_background() else 0.0)
        control.on_agreed(self._decide)

    def _time_due(self) -> bool:
        return (bool(self.every_n_minutes) and self._saver is not None
                and time.monotonic() - self._saver.last_save_time >= self.every_n_minutes * 60)

    def _decide(self, trainer, agreed: Agreed) -> None:
        if agreed["checkpoint.save_failed"]:
            self._saver.wait_for_save(trainer)  # every rank: agrees on the failure and raises it (exit 16, 17 or 1)
        if agreed["checkpoint.save_due"]:
            self._control.request_save("time")

    # -- where ------------------------------------------------------------------------------

    def store(self, trainer) -> CheckpointStore:
        if self._store is None:
            run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
            run_id = os.environ.get(RUN_ID_ENV) or os.path.basename(os.path.normpath(run_dir))
            url = self.dirpath.format(run_dir=run_dir, run_id=run_id)
            self._store = CheckpointStore(url, self.storage_options, self.outage_deadline_s)
        return self._store

    def saver(self, trainer) -> Saver:
        """The writer of this run's checkpoints (made once the folder is known)."""
        if self._saver is None:
            self._saver = Saver(self.store(trainer), self._io,
                                Rotation(self.keep_last_n, self.monitor, self.mode, self.keep_best_k),
                                self.async_save, self._published)
            self._saver.resumed_from = self.resumed_from
        return self._saver

    def _published(self, saved: dict) -> None:
        if self._control is not None:
            self._control.publish(Event("checkpoint.saved", "info", f"Checkpoint at step {saved['step']}",
                                        saved["path"], saved))

    @property
    def last_path(self) -> str | None:
        """The newest complete checkpoint this run wrote."""
        return self._saver.last_path if self._saver is not None else None

    # -- resume (called by the CLI on every process, before the process group exists) ----------

    def resolve_ckpt_path(self, trainer, ckpt_path: str | None) -> str | None:
        """What to load: ``auto`` is the newest usable checkpoint or None; a checkpoint folder is verified."""
        if ckpt_path is None:
            return None
        store = self.store(trainer) if trainer is not None else self._store
        share = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if ckpt_path != "auto":
            return self._explicit(ckpt_path, store, share)
        choice = resume.newest_usable(store, self.verify_checksums, share)
        self._chosen = choice
        for bad, problem in choice.skipped:
            rank_zero_warn(f"lit-dist: checkpoint {store.url_of(bad)} is unusable: {problem}; "
                           + (f"falling back to {choice.name}" if choice.name else "trying an older one"))
        if choice.name is None:
            if not choice.fresh_start:
                raise CheckpointError(f"ckpt_path: auto found {choice.problem}. Move them away or pass ckpt_path: null "
                                      "to start over, or ckpt_path: <folder> to load one anyway.")
            rank_zero_info(f"lit-dist: no checkpoint in {store.url} yet"
                           + (f" ({len(choice.skipped)} unfinished saves)" if choice.skipped else "")
                           + ": starting from the beginning")
            return None
        self._protect(choice.name)
        rank_zero_info(f"lit-dist: resuming from {store.url_of(choice.name)} (step {store.manifest(choice.name).get('step')})")
        return choice.state

    def _explicit(self, ckpt_path: str, own: CheckpointStore | None, share: tuple[int, int]) -> str:
        """A lit-dist checkpoint folder (or its state.ckpt) is verified first; anything else goes to Lightning as is."""
        choice = resume.explicit(ckpt_path, self.storage_options, self.verify_checksums, self.outage_deadline_s, share)
        if choice is None:
            return ckpt_path
        self._chosen = choice
        if choice.name is None:
            raise CheckpointError(f"ckpt_path: {ckpt_path} is unusable: {choice.damaged[0][1]}. Pick another checkpoint, "
                                  "or ckpt_path: auto for the newest usable one.")
        if own is not None and choice.store.root == own.root:  # rotation must keep it
            self._protect(choice.name)
        return choice.state

    def _protect(self, name: str) -> None:
        self.resumed_from = name
        if self._saver is not None:
            self._saver.resumed_from = name

    # -- lifecycle ----------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        store = self.store(trainer)
        if not (store.local or compat.rank_zero_writes(trainer.strategy) or compat.writes_dcp_shards(trainer.strategy)):
            raise ConfigError(f"checkpoint.dirpath: {store.url} is an object store, where the sharded checkpoints of "
                              f"{type(trainer.strategy).__name__} cannot be written; use a shared filesystem path, or "
                              "a strategy whose checkpoints lit-dist writes there (ddp, fsdp2)")
        if self.async_save and not (compat.rank_zero_writes(trainer.strategy) or compat.writes_dcp_shards(trainer.strategy)):
            rank_zero_warn(f"lit-dist: checkpoint.async_save is for DDP, single devices and FSDP2; "
                           f"{type(trainer.strategy).__name__} saves synchronously")
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a user's own CheckpointIO stays
            trainer.strategy.checkpoint_io = self._io
        if trainer.world_size > 1:
            self._agree_on_resume(trainer)
        if stage != "fit":
            return
        token = trainer.strategy.broadcast(uuid.uuid4().hex) if trainer.world_size > 1 else ""
        probe = store.path(f"{PROBE}{token}")
        store.who = self._io.who = f"rank {trainer.global_rank}: " if trainer.world_size > 1 else ""
        unwritable = unreachable = None
        if trainer.is_global_zero:
            try:  # caught: the other ranks must still reach the agreement below, not wait for rank 0 forever
                store.remote(lambda: store.fs.makedirs(store.root, exist_ok=True), "making", f"the checkpoint folder {store.url}")
                for leftover in store.clean():
                    log.info("lit-dist: removed %s, left by an interrupted save", leftover)
                if trainer.world_size > 1:
                    store.remote(lambda: write_bytes_atomically(store.fs, probe, token.encode()), "writing",
                                 store.url_of(f"{PROBE}{token}"))
            except OSError as exc:
                unwritable = f"{type(exc).__name__}: {exc}"
            except StoreUnreachable as exc:
                unreachable = exc
        if trainer.world_size > 1:
            self._check_shared(trainer, probe, token, unwritable, unreachable)
        elif unreachable:
            raise unreachable
        elif unwritable:
            raise ConfigError(f"checkpoint.dirpath: cannot write to {store.url} ({unwritable})")
        self.saver(trainer).last_save_time = time.monotonic()

    def _check_shared(self, trainer, probe: str, token: str, unwritable: str | None,
                      unreachable: StoreUnreachable | None) -> None:
        """Every rank must see what rank 0 wrote, and resume from the same checkpoint; else fail before training.
        An object store that stays away ends every rank with the same line (exit 17), rank 0's or the first reader's."""
        store = self._store
        # Also the barrier that keeps the other ranks from looking before rank 0 wrote the probe.
        if gone := trainer.strategy.broadcast(str(unreachable) if unreachable else None):
            raise StoreUnreachable(gone) from unreachable
        lost = None

        def read() -> bool:
            with store.fs.open(probe, "rb") as f:
                return f.read().decode() == token

        try:
            sees = store.remote(read, "reading", store.url_of(f"{PROBE}{token}"))
        except OSError:
            sees = False
        except StoreUnreachable as exc:
            sees, lost = False, str(exc)
        reports = [_Seen(*report) for report in all_gather_object(
            trainer, (trainer.global_rank, socket.gethostname(), sees, unwritable, store.url, lost))]
        if gone := next((report.lost for report in reports if report.lost), None):
            raise StoreUnreachable(gone)
        if trainer.is_global_zero and not unwritable:
            try:
                store.remote(lambda: store.fs.rm(probe), "deleting", store.url_of(f"{PROBE}{token}"))
            except StoreUnreachable as exc:
                lost = str(exc)
        if gone := trainer.strategy.broadcast(lost if trainer.is_global_zero else None):
            raise StoreUnreachable(gone)
        if problem := reports[0].unwritable:
            raise ConfigError(f"checkpoint.dirpath: rank 0 cannot write to {store.url} ({problem})")
        if len({report.url for report in reports}) > 1:
            raise ConfigError(
                "the processes of this run chose different run directories ("
                + ", ".join(f"rank {r.rank}: {r.url}" for r in reports[:4]) + (", ..." if len(reports) > 4 else "")
                + "): give them all the same run.run_id (torchrun across machines: --rdzv-id=NAME; "
                "DeepSpeed launcher: --run.run_id NAME)")
        blind = [f"rank {r.rank} on {r.host}" for r in reports if not r.sees]
        if blind:
            raise ConfigError(
                f"checkpoint.dirpath: {store.url} is not shared: {', '.join(blind)} cannot see the files rank 0 writes "
                "there. Runs on several nodes need run.root_dir and checkpoint.dirpath on a shared filesystem (NFS, "
                "Lustre) or an object store (checkpoint.dirpath: s3://bucket/prefix/{run_id}).")

    def _agree_on_resume(self, trainer) -> None:
        """Every rank resumes from the same checkpoint, and each verified only its share of the files before the
        process group existed: a damaged file any rank found is marked in the manifest by rank 0, and every rank
        stops with the same line (Lightning already holds the path it will load). The next start passes over it."""
        chosen = self._chosen
        found = chosen.share_problem if chosen is not None and chosen.name else None
        reports = all_gather_object(trainer, (trainer.global_rank, socket.gethostname(), self.resumed_from, found))
        if len({source for _, _, source, _ in reports}) > 1:
            raise CheckpointError("ranks would resume from different checkpoints ("
                                  + ", ".join(f"rank {rank}: {source or 'none'}" for rank, _, source, _ in reports)
                                  + f"); the checkpoint folder {self._store.url} changed while the run started. "
                                  "Start it again.")
        findings = [f"rank {rank} on {host} found {problem}" for rank, host, _, problem in reports if problem]
        if not findings:
            return
        why = "; ".join(findings[:3]) + (f" (and {len(findings) - 3} more ranks)" if len(findings) > 3 else "")
        failed = None
        if trainer.is_global_zero:
            try:  # caught: the other ranks wait for this outcome
                chosen.store.mark_damaged(chosen.name, why)
            except (OSError, StoreUnreachable) as exc:
                failed = f"{type(exc).__name__}: {exc}"
        failed = trainer.strategy.broadcast(failed)
        then = (f"marking it damaged failed ({failed}): move it away before starting again" if failed else
                f"it is now marked damaged in its {MARKER}: start the run again, and ckpt_path: auto resumes from "
                "the checkpoint before it")
        raise CheckpointError(f"checkpoint {chosen.store.url_of(chosen.name)} is damaged: {why}; {then}")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.every_n_minutes and self._control is None:
            raise ConfigError("checkpoint.every_n_minutes needs lit_dist.runtime.control.RunControl among the trainer's "
                              "callbacks (lit-dist fit adds it; add RunControl() when building a Trainer yourself)")
        # As late as possible: whatever ran since the checkpoint was loaded must not shift the streams.
        if self._rng is not None and len(self._rng) == trainer.world_size:
            set_rng_state(self._rng[trainer.global_rank])
        else:
            if self._rng is not None:
                rank_zero_warn(f"lit-dist: the checkpoint holds random states of {len(self._rng)} ranks and this run "
                               f"has {trainer.world_size}: random streams restart from the seed")
            start_rank_streams(trainer.global_rank)
        self._rng = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_seen_step:  # accumulating gradients: no optimizer step since the last batch
            return
        if self.resumed_from and self._last_seen_step < 0:
            age = age_s()
            rank_zero_info(f"lit-dist: first step after resuming (step {step}) done"
                           + (f" {age:.1f} s after the process started" if age is not None else ""))
        self._last_seen_step = step
        # Epoch saves happen here, after the epoch's last batch (see lit_dist.runtime.compat.as_next_epoch_start).
        last_batch = compat.is_last_batch(trainer)
        epochs_done = trainer.current_epoch + 1
        reason = None
        if self.every_n_steps and step % self.every_n_steps == 0:
            reason = "steps"
        if self.every_n_epochs and last_batch and epochs_done % self.every_n_epochs == 0:
            reason = "epoch"
        if self.save_last and (trainer.should_stop or 0 < trainer.max_steps <= step
                               or (last_batch and epochs_done >= (trainer.max_epochs or 0) > 0)):
            reason = "end"
        if reason:
            self.save(trainer, reason)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self.monitor or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        # Saved whatever the value: a decision taken from a value only some ranks have would hang the others.
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            rank_zero_warn(f"lit-dist: checkpoint.monitor {self.monitor!r} was not logged; logged metrics are "
                           f"{sorted(trainer.callback_metrics)}")
        metric = {"name": self.monitor, "value": None if value is None else float(value)}
        self.save(trainer, "validation", metric)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.save_last:
            self.save(trainer, "end")  # only if training ended elsewhere than after a batch (e.g. early stopping)
        self.wait_for_save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Let a save in flight finish: it is complete or absent either way, but complete is better.
        # No collective here: the other ranks may be anywhere.
        self._log_background_error("the background checkpoint save failed too")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # Nothing to wait for unless neither on_train_end nor on_exception waited.
        self._log_background_error("the background checkpoint save failed")
        CheckpointStore.wait_for_deletions()

    def _log_background_error(self, what: str) -> None:
        error = self.background_error(timeout_s=600)
        if error is not None:
            text, bug = summary(error)
            log.error("lit-dist: %s: %s", what, text, exc_info=error if bug else None)

    # -- state --------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Every rank's streams, gathered into the one file rank 0 writes (a collective: every rank gets here).
        checkpoint["lit_dist"] = {"rng": all_gather_object(trainer, rng_state())}
        if trainer.training and compat.is_last_batch(trainer) and "loops" in checkpoint:
            compat.as_next_epoch_start(checkpoint["loops"]["fit_loop"])

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._rng = (checkpoint.get("lit_dist") or {}).get("rng")

    # -- saving (also the run control's saver) -------------------------------------------------

    def save(self, trainer, reason: str, metric: dict | None = None) -> str:
        """Save a checkpoint of this step now and return where. Call it on every rank at the same step."""
        return self.saver(trainer).save(trainer, reason, metric)

    def wait_for_save(self, trainer) -> None:
        """Wait for an asynchronous save in flight; every rank learns whether it failed."""
        if self._saver is not None:
            self._saver.wait_for_save(trainer)

    def background_error(self, timeout_s: float | None = None) -> BaseException | None:
        """Wait for this rank's asynchronous write in flight; its exception, else None."""
        return self._saver.background_error(timeout_s) if self._saver is not None else None

    @property
    def best_model_path(self) -> str:
        """The state file of the checkpoint with the best monitored value ('' without one); Lightning's ``ckpt_path='best'``."""
        name = self._store.best(self.monitor, self.mode) if self.monitor and self._store is not None else None
        return self._store.url_of(name, STATE) if name else ""
