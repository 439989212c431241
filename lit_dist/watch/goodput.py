"""Goodput: where a run's wall time went, over every attempt of it (requeues, restarts after a crash).

Categories, in seconds of wall time on rank 0 (every rank trains in lockstep):

==============  =====================================================================================
``train``       training steps the run kept (forward, backward, optimizer), loader waits excluded
``data_wait``   the training loop waiting for its next batch
``checkpoint``  the training thread held by saves (the copy only, for asynchronous saves)
``validation``  validation during ``fit``, its samples excluded
``sampling``    images made from the fixed prompts (``samples``), at validation or every n steps
``startup``     each attempt from its process start to its first training batch: imports, process
                group, data setup, resume, sanity check
``lost``        whatever earlier attempts did after the checkpoint the run resumed from: the steps
                trained again (``steps_redone``), and all of an attempt that left no checkpoint
``other``       the rest: the loop's own work between batches, logging, the end of ``fit``
==============  =====================================================================================

``goodput`` is ``train`` over the total. The ledger travels in every checkpoint, so it adds up over
requeues. What an attempt did after its last checkpoint is known from its journal: rank 0 keeps, in
``{run_dir}/goodput/``, one small JSON file per attempt (its start, each save, how it ended) and a
fixed 64-byte record of its last finished step, rewritten in place after every optimizer step (one
``pwrite`` to the page cache, a few microseconds: it survives the process being killed, not the
machine losing power). An attempt killed without a word counts until its last recorded step.
"""

import json
import logging
import os
from dataclasses import asdict, dataclass, field

from lit_dist.runtime.counter import hms

log = logging.getLogger(__name__)

CATEGORIES = ("train", "data_wait", "checkpoint", "validation", "sampling", "startup", "lost", "other")
_RECORD = 64  # bytes of the last-step record: '{"step": N, "time": T}' padded with spaces


@dataclass
class Ledger:
    """Seconds per category over every attempt, with what the restarts cost."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    steps_redone: int = 0
    attempts: int = 1  # starts of the run, this one included
    restarts: list[dict] = field(default_factory=list)  # one per earlier attempt whose work was lost in part

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float:
        return self.seconds["train"] / self.total if self.total > 0 else 0.0

    def plus(self, seconds: dict[str, float]) -> "Ledger":
        """This ledger with ``seconds`` (per category) added."""
        return Ledger({k: v + seconds.get(k, 0.0) for k, v in self.seconds.items()}, self.steps_redone,
                      self.attempts, list(self.restarts))

    def to_dict(self) -> dict:
        return {**asdict(self), "total_s": round(self.total, 3), "goodput": round(self.goodput, 4)}

    @classmethod
    def from_dict(cls, state: dict) -> "Ledger":
        seconds = dict.fromkeys(CATEGORIES, 0.0) | {k: float(v) for k, v in state.get("seconds", {}).items()}
        return cls(seconds, int(state.get("steps_redone", 0)), int(state.get("attempts", 1)),
                   list(state.get("restarts", [])))

    def summary(self) -> str:
        """One line: goodput and where the rest went."""
        s = self.seconds
        parts = [f"train {hms(s['train'])}", f"data wait {hms(s['data_wait'])}",
                 f"checkpoints {hms(s['checkpoint'])}", f"validation {hms(s['validation'])}",
                 *([f"sampling {hms(s['sampling'])}"] if s["sampling"] else []),
                 f"start-up {hms(s['startup'])} ({self.attempts} start{'s' if self.attempts != 1 else ''})"]
        if self.restarts or s["lost"]:
            parts.append(f"lost {hms(s['lost'])} ({len(self.restarts)} restart{'s' if len(self.restarts) != 1 else ''}, "
                         f"{self.steps_redone} steps redone)")
        parts.append(f"other {hms(s['other'])}")
        return f"goodput {self.goodput:.1%} of {hms(self.total)}: " + ", ".join(parts)


class Journal:
    """Rank 0's record of one attempt in ``folder``: ``attempt-NNN.json`` and ``attempt-NNN.step``.

    A write that fails once the journal is made (a full disk: the checkpoint that just filled it) is said in one
    warning, not raised: raised in rank 0 alone, it would leave the other ranks waiting in the next collective,
    and the disk's own line comes from the next save, on every rank. Later writes still try: the whole file or
    none, as before."""

    def __init__(self, folder: str, attempt: int, started: float, resumed_step: int | None,
                 total_steps: int | None = None):
        import socket

        self.folder = folder
        self.attempt = attempt
        self.info = {"attempt": attempt, "started": started, "resumed_step": resumed_step, "total_steps": total_steps,
                     "host": socket.gethostname(), "pid": os.getpid(), "first_batch": None, "saves": [], "ended": None}
        self._warned = False  # a write failed, and the warning was given
        os.makedirs(folder, exist_ok=True)
        self._fd = os.open(self._path(".step"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            self._write_info_file()  # raised: no journal (see lit_dist.callbacks.progress)
        except OSError:
            os.close(self._fd)
            raise

    def _path(self, suffix: str) -> str:
        return os.path.join(self.folder, f"attempt-{self.attempt:03d}{suffix}")

    def step(self, step: int, now: float) -> None:
        """Record the last finished optimizer step (every step: one pwrite, no fsync)."""
        record = f'{{"step": {step}, "time": {now:.3f}}}'.ljust(_RECORD - 1).encode() + b"\n"
        try:
            os.pwrite(self._fd, record, 0)  # in place: it goes on after the disk filled
        except OSError as exc:
            self._failed(exc)

    def first_batch(self, step: int, now: float) -> None:
        """Training began (start-up is over) at ``step``: with the last step, the speed of this attempt."""
        self.info["first_batch"] = [step, round(now, 3)]
        self._write_info()

    def saved(self, step: int, now: float) -> None:
        self.info["saves"].append([step, round(now, 3)])
        self._write_info()

    def ended(self, how: str, step: int, now: float) -> None:
        self.step(step, now)
        self.info["ended"] = how
        self._write_info()
        os.close(self._fd)

    def _write_info(self) -> None:
        try:
            self._write_info_file()
        except OSError as exc:
            self._failed(exc)

    def _write_info_file(self) -> None:
        import fsspec

        from lit_dist.ckpt.files import write_bytes_atomically

        write_bytes_atomically(fsspec.filesystem("file"), self._path(".json"), json.dumps(self.info).encode())

    def _failed(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("lit-dist: cannot write the goodput journal %s (%s); training goes on, and `lit-dist "
                        "report` counts this attempt as far as it was written", self._path(".json"), exc)


def attempts(folder: str) -> list[dict]:
    """Every attempt journaled in ``folder``, oldest first, each with ``last_step`` and ``last_time`` (or None)."""
    found = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("attempt-") and n.endswith(".json"))
    except FileNotFoundError:
        return []
    for name in names:
        try:
            with open(os.path.join(folder, name)) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue  # a journal cut off mid-write: that attempt is unknown
        info["last_step"] = info["last_time"] = None
        try:
            with open(os.path.join(folder, name[:-5] + ".step")) as f:
                record = json.loads(f.read().strip() or "null")
            if record:
                info["last_step"], info["last_time"] = int(record["step"]), float(record["time"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        found.append(info)
    return found


def losses(previous: list[dict], resumed_step: int, saved_by: int | None, saved_at: float | None) -> list[dict]:
    """What each earlier attempt lost, for a run resuming at ``resumed_step`` from a checkpoint that attempt
    ``saved_by`` saved at time ``saved_at`` (both None for a start without checkpoint).

    The attempt that saved it lost what it did after the save; every later one lost all it did (it left no
    checkpoint that this start uses). Earlier attempts' losses are already in the checkpoint's ledger.
    """
    lost = []
    for info in previous:
        if saved_by is not None and info["attempt"] < saved_by:
            continue
        end_step, end_time = info["last_step"], info["last_time"]
        if info["attempt"] == saved_by:
            begin_step, begin_time = resumed_step, saved_at
        else:
            begin_step, begin_time = info["resumed_step"] or 0, info["started"]
        if end_time is None:  # died before its first step: its start-up was lost, as far as it is known
            end_step, end_time = begin_step, max(begin_time, _journal_time(info))
        lost.append({"attempt": info["attempt"], "ended": info["ended"] or "killed (no word)",
                     "resumed_step": info["resumed_step"], "last_step": end_step,
                     "steps_redone": max(end_step - begin_step, 0), "lost_s": round(max(end_time - begin_time, 0.0), 3)})
    return lost


def _journal_time(info: dict) -> float:
    saves = info.get("saves") or []
    return saves[-1][1] if saves else info["started"]
