"""Which checkpoint a run (or ``lit-dist export``) may load: the one decision, in one place.

- ``newest_usable(store)``: the newest checkpoint whose files match its manifest, and why each newer
  one was passed over. A save cut off before its marker (on an object store it stays at its final
  name) never was a checkpoint; a complete one that fails its manifest is damaged.
- ``Choice.fresh_start``: with no usable checkpoint, a run starts over only when nothing but
  unfinished saves is there (nothing is lost); damaged complete checkpoints are progress that would
  be lost, which needs a person (``Choice.problem``).
- ``explicit(path)``: a checkpoint named by the user (a lit-dist checkpoint folder or its state file)
  is verified against its manifest; anything else (a plain Lightning file) is not lit-dist's to judge.
- ``share=(rank, world)``: the ranks of a run pick the same checkpoint from its marker alone (finished,
  readable, not marked damaged) and each reads only its share of the files, so that 1,024 ranks read a
  checkpoint once, not 1,024 times. What a rank finds is ``Choice.share_problem``; the run agrees on the
  findings once the process group exists (``lit_dist.callbacks.checkpoint``), marks a damaged checkpoint
  and stops, and its next start passes over it.
"""

from dataclasses import dataclass, field

from lit_dist.ckpt.store import MARKER, STATE, CheckpointStore
from lit_dist.runtime import outage


@dataclass
class Choice:
    """The outcome of looking for a checkpoint in one folder."""

    store: CheckpointStore
    name: str | None  # the newest usable checkpoint, or None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer ones passed over, (name, why)
    damaged: list[tuple[str, str]] = field(default_factory=list)  # of those, the complete ones
    share_problem: str | None = None  # what this rank found in its share of ``name``'s files (``share``)

    @property
    def state(self) -> str | None:
        """What Lightning loads: the state file (or folder) of the chosen checkpoint."""
        return self.store.url_of(self.name, STATE) if self.name else None

    @property
    def fresh_start(self) -> bool:
        """No usable checkpoint, and none lost either: only unfinished saves (or nothing) are there."""
        return self.name is None and not self.damaged

    @property
    def problem(self) -> str:
        """Why no checkpoint is usable although complete ones exist."""
        return (f"{len(self.damaged)} complete checkpoints in {self.store.url} and none is usable ("
                + "; ".join(f"{n}: {p}" for n, p in self.damaged) + ")")


def newest_usable(store: CheckpointStore, verify_checksums: bool = True, share: tuple[int, int] = (0, 1)) -> Choice:
    """The newest checkpoint of ``store`` whose files match its manifest (see the module docstring)."""
    if share[1] > 1:
        skipped = []
        for name in store.names():
            if problem := store.unusable(name):
                skipped.append((name, problem))
                continue
            return Choice(store, name, skipped, share_problem=store.files_problem(name, verify_checksums, share))
        name = None
    else:
        name, skipped = store.find_valid(verify_checksums)
    complete = set(store.complete()) if name is None and skipped else set()
    return Choice(store, name, skipped, [(n, p) for n, p in skipped if n in complete])


def explicit(path: str, storage_options: dict | None = None, verify_checksums: bool = True,
             outage_deadline_s: float = outage.DEADLINE_S, share: tuple[int, int] = (0, 1)) -> Choice | None:
    """A lit-dist checkpoint folder named by the user (or its ``state.ckpt``), verified; None when ``path``
    is not a lit-dist checkpoint folder. ``Choice.damaged`` names its problem when it is unusable."""
    path = path.rstrip("/")
    folder = path.rsplit("/", 1)[0] if path.endswith("/" + STATE) else path
    parent, _, name = folder.rpartition("/")
    store = CheckpointStore(parent or ".", storage_options, outage_deadline_s)
    if not store.remote(lambda: store.fs.exists(store.path(name, MARKER)), "reading", f"checkpoint {folder}"):
        return None
    problem = store.unusable(name)
    if problem is None and (found := store.files_problem(name, verify_checksums, share)):
        if share[1] > 1:  # this rank's share only: the run agrees on it (``Choice.share_problem``)
            return Choice(store, name, share_problem=found)
        problem = found
    return Choice(store, None, [(name, problem)], [(name, problem)]) if problem else Choice(store, name)
