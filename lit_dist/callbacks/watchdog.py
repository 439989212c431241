"""``HangWatchdog``: a rank that stops making progress is caught in minutes, named, and the job ends with exit 12.

Without it, a rank stuck in a step (a dead GPU, a deadlocked loader, a collective that one rank never
joins) holds every other rank inside a collective until the collective timeout (30 minutes in
Lightning), and the job then dies without saying which rank was stuck.

Every rank runs one thread that
- notes the training loop's progress, ``(step, phase)`` with phases waiting for the batch, forward,
  backward, optimizer step; the training thread only writes two integers (no I/O, no collective, no
  sync); and the number of collectives this rank has issued (the process group's sequence number);
- every ``heartbeat_s`` writes that progress to the job's rendezvous store (the TCPStore the process
  group was made with: a key per rank, from this thread, never from the training thread) and checks
  whether another rank declared a hang;
- when no optimizer step finished for ``timeout_s`` (default: ``step_factor`` times the slowest step
  seen so far, at least ``min_timeout_s``, and always at most half the collective timeout), or when
  another rank declared a hang: writes all its threads' Python stacks to ``{run_dir}/hang/rank-N.txt``;
  the first rank to notice reads every rank's last progress from the store (not through a collective,
  which would hang too) and names the ranks behind: those that issued fewer collectives than the others
  (they never joined the one the others wait in), else those least far in the step; it publishes
  ``run.hung`` and (under Slurm, ``requeue``)
  requeues the job; then every process exits with code 12, so the scheduler can restart the job at once.

It starts with fit (the callbacks' ``setup``): until the first optimizer step finishes, the limit is
``startup_timeout_s`` (default half the collective timeout: start-up, the sanity check and the first step,
compilation and warm-up included), so a rank stuck before its first step is named too. A rank that never
published its progress counts as the one behind. From the start of a validation or a checkpoint save until the
next training batch starts, the limit is half the collective timeout (a large model's save takes minutes).

A rank stuck while holding the interpreter lock runs no Python thread, this one included: its last resort
(lit_dist/runtime/last_resort.py) dumps its stacks from C ``last_resort_after_s`` after its own deadline and exits 12
two seconds later. The rank that declares the hang waits for the dumps of the ranks behind (at most that long)
before it exits, so every rank's stacks are on disk. Configured by the CLI's ``watchdog`` group::

    watchdog:
      timeout_s: 600          # fixed; default: derived from the step times
      startup_timeout_s: 900  # from the start of fit to the first finished step
      heartbeat_s: 5
"""

import logging
import os
import socket
import sys
import threading
import time
import traceback

from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, ExitCode
from lit_dist.runtime import compat, roll_call
from lit_dist.runtime.control import Event, RunControl
from lit_dist.runtime.last_resort import EXIT_AFTER_DUMP_S, WORKER_DUMPS_ENV, LastResort, dump_helpers
from lit_dist.runtime.roll_call import STORE_ERRORS, rendezvous_store
from lit_dist.runtime.slurm import check_exclusion

log = logging.getLogger(__name__)

# Where a rank is in the step after its last finished one, in order ("starting": before its first batch).
PHASES = ("starting", "waiting for the batch", "forward", "backward", "optimizer step")
_KEY = "lit-dist/watchdog"


class HangWatchdog(Callback):
    """Catches a rank that stops making progress well before the collective timeout, names it, exits 12."""

    def __init__(self, enabled: bool = True, timeout_s: float | None = None, min_timeout_s: float = 300.0,
                 step_factor: float = 20.0, heartbeat_s: float = 5.0, requeue: bool = True,
                 exclude_node: bool = False, startup_timeout_s: float | None = None):
        """Hang watchdog settings.

        Args:
            enabled: Run the watchdog thread on every rank.
            timeout_s: Seconds without a finished optimizer step that mean a hang; default: step_factor x slowest step, at least min_timeout_s.
            min_timeout_s: Lower bound of the derived timeout (a slow validation or checkpoint is not a hang).
            step_factor: The derived timeout is this many times the slowest optimizer step seen so far.
            heartbeat_s: Seconds between writes of this rank's progress to the rendezvous store (and checks for another rank's hang).
            requeue: Under Slurm, requeue the job when a hang ends it (scontrol requeue), to restart from its last checkpoint.
            exclude_node: Under Slurm, when the ranks behind are all on one node, requeue the job without that node.
            startup_timeout_s: Seconds from the start of fit to the first finished optimizer step that mean a hang; default: half the collective timeout.
        """
        problems = []
        if timeout_s is not None and timeout_s <= 0:
            problems.append(f"watchdog.timeout_s = {timeout_s}: must be positive (seconds), or null to derive it")
        if min_timeout_s <= 0:
            problems.append(f"watchdog.min_timeout_s = {min_timeout_s}: must be positive (seconds)")
        if step_factor < 2:
            problems.append(f"watchdog.step_factor = {step_factor}: below 2, an ordinary slow step would count as a hang")
        if startup_timeout_s is not None and startup_timeout_s <= 0:
            problems.append(f"watchdog.startup_timeout_s = {startup_timeout_s}: must be positive (seconds), or null for "
                            "half the collective timeout")
        if heartbeat_s <= 0:
            problems.append(f"watchdog.heartbeat_s = {heartbeat_s}: must be positive (seconds)")
        elif timeout_s is not None and heartbeat_s * 2 > timeout_s:
            problems.append(f"watchdog.heartbeat_s = {heartbeat_s} with timeout_s = {timeout_s}: the heartbeat must be at "
                            "most half the timeout, or a rank's progress reaches the others too late to name it")
        ConfigError.collect(problems)
        check_exclusion("watchdog.exclude_node", exclude_node)
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.min_timeout_s = min_timeout_s
        self.step_factor = step_factor
        self.heartbeat_s = heartbeat_s
        self.requeue = requeue
        self.exclude_node = exclude_node
        self.startup_timeout_s = startup_timeout_s
        self._control: RunControl | None = None
        self._step = 0
        self._phase = 0
        self._progress_at = time.monotonic()  # when the last optimizer step finished
        self._step_started = time.monotonic()
        self._slowest = 0.0  # seconds of the slowest optimizer step so far
        self._armed = False  # the first optimizer step finished: the step timeouts apply
        self._last_resort: LastResort | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hanging = False  # the watchdog thread is ending the process
        self._relaxed = False  # in validation or a checkpoint save: the limit is half the collective timeout
        self._limit: float | None = None  # half the collective timeout

    def connect(self, control: RunControl) -> None:
        self._control = control

    # -- the training thread: two integers and a clock -----------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._phase = 2
        if self._relaxed:  # a save or validation came before this batch: the step's clock starts now
            self._relaxed, self._progress_at = False, time.monotonic()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._phase = 3

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._phase = 4

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._step:  # an accumulated micro-batch: no optimizer step yet
            return
        now = time.monotonic()
        if self._armed:
            self._slowest = max(self._slowest, now - self._progress_at)
        self._step, self._phase, self._progress_at = step, 1, now
        if not self._armed:
            self._armed = True
            if self._last_resort is not None:  # from the start-up deadline to the (much shorter) step one, now:
                self._last_resort.arm(self.timeout() + self.last_resort_after_s())  # the thread may not run again

    # Validation and checkpoint saves have no optimizer step and may take long (a large model's save
    # takes minutes): until the next training batch starts, the limit is half the collective timeout.
    def on_validation_start(self, trainer, pl_module) -> None:
        self._relaxed = True

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._relaxed = True

    # -- start and stop ----------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        collective = compat.collective_timeout_s(trainer.strategy)
        self._limit = collective / 2
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if value is not None and value >= collective:
                raise ConfigError(f"watchdog.{name} = {value}: at or above the collective timeout ({collective:.0f} s), "
                                  f"the collective would time out first; use at most {self._limit:.0f}")
        self._step, self._phase, self._armed, self._relaxed = trainer.global_step, 0, False, False
        self._progress_at = time.monotonic()
        self._stop.clear()
        self._last_resort = LastResort(_hang_file(trainer.default_root_dir, trainer.global_rank))
        # Armed here, not only by the thread: this thread may hold the interpreter lock before that one first runs.
        self._last_resort.arm(self.timeout() + self.last_resort_after_s())
        # Loader workers started from now on dump their stacks next to this rank's when it dumps.
        os.environ[WORKER_DUMPS_ENV] = _hang_file(trainer.default_root_dir, trainer.global_rank).removesuffix(".txt")
        self._thread = threading.Thread(target=self._watch, args=(trainer,), name="lit-dist-watchdog", daemon=True)
        self._thread.start()

    def on_train_end(self, trainer, pl_module) -> None:
        self._halt()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._halt()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # A collective that failed because a hung job's other ranks are exiting: end as they do, with 12.
        if self._hanging:
            self._thread.join()  # it ends the process
        stuck = time.monotonic() - self._progress_at > self.heartbeat_s  # not a prompt error
        if self._thread is not None and stuck and self._declared(trainer):
            self._stop.set()
            self._hang(trainer, None, noticed=False)
        self._halt()

    def _declared(self, trainer) -> bool:
        store = rendezvous_store() if trainer.world_size > 1 else None
        try:
            return store is not None and store.check([f"{_KEY}/hung"])
        except STORE_ERRORS:  # the store went with rank 0
            return False

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
            self._thread = None
        if self._last_resort is not None and not self._hanging:
            self._last_resort.close()
            self._last_resort = None
            _remove_unused_dumps(os.environ.pop(WORKER_DUMPS_ENV, None))

    # -- the watchdog thread ----------------------------------------------------------------------

    def timeout(self) -> float:
        """Seconds without a finished step that count as a hang, now."""
        if not self._armed:
            return self.startup_timeout_s or max(self._limit or 900.0, self.timeout_s or 0.0)
        if self._relaxed and self._limit:
            return max(self._limit, self.timeout_s or 0.0)
        if self.timeout_s is not None:
            return self.timeout_s
        derived = max(self.min_timeout_s, self.step_factor * self._slowest)
        return min(derived, self._limit) if self._limit else derived

    def last_resort_after_s(self) -> float:
        """Seconds past its own deadline after which a rank that cannot run this thread dumps and exits: long
        enough for this thread, when it runs, to declare the hang and disarm the last resort first."""
        return 2 * self.heartbeat_s + 5.0

    def _watch(self, trainer) -> None:
        rank, world = trainer.global_rank, trainer.world_size
        store = rendezvous_store() if world > 1 else None
        poll = min(1.0, self.heartbeat_s)
        next_beat = 0.0
        armed_for = None
        if store is not None:
            try:  # who this rank is, for the ranks left if it goes away (lit_dist/runtime/roll_call.py)
                roll_call.register(store, rank, self.heartbeat_s)
            except STORE_ERRORS as exc:
                log.debug("lit-dist watchdog: store unreachable (%s)", exc)
        while not self._stop.wait(poll):
            now = time.monotonic()
            # Pushed forward while this thread runs; fires when it cannot (the interpreter lock held).
            deadline = self._progress_at + self.timeout() + self.last_resort_after_s()
            if armed_for is None or abs(deadline - armed_for) > 0.5:
                self._last_resort.arm(deadline - now)
                armed_for = deadline
            declared = False
            if store is not None and now >= next_beat:
                next_beat = now + self.heartbeat_s
                try:
                    store.set(f"{_KEY}/progress/{rank}", f"{compat.collectives_issued()} {self._step} {self._phase}")
                    roll_call.beat(store, rank)
                    declared = store.check([f"{_KEY}/hung"])
                except STORE_ERRORS as exc:  # the store is gone: the job is ending anyway
                    log.debug("lit-dist watchdog: store unreachable (%s)", exc)
            stalled = now - self._progress_at > self.timeout()
            if stalled or declared:
                self._hang(trainer, store, noticed=stalled and not declared)
                return

    def _hang(self, trainer, store, noticed: bool) -> None:
        self._hanging = True
        if self._last_resort is not None:
            self._last_resort.disarm()  # this thread runs: it ends the process itself
        rank, world = trainer.global_rank, trainer.world_size
        waited = time.monotonic() - self._progress_at
        first = noticed
        if store is not None and noticed:
            try:  # the first rank to declare it names the ranks behind and tells the world
                first = store.add(f"{_KEY}/hung", 1) == 1
            except STORE_ERRORS:  # the store is gone with its rank: this rank speaks for itself
                first = True
        path = _dump_stacks(_hang_file(trainer.default_root_dir, rank), rank, self._step, self._phase, waited)
        if first:
            behind, progress = _behind(store, world, rank, self._step, self._phase)
            node_of = (lambda r: self._control.where(r)["node"]) if self._control is not None else (lambda r: None)
            names = ", ".join(f"{r} ({node_of(r)})" if node_of(r) else str(r) for r in behind) or \
                "none (every rank at the same point)"
            where = "; ".join(f"rank {r}: {c} collectives, step {s + 1} {PHASES[p]}" if s >= 0 else
                              f"rank {r}: never published its progress" for r, (c, s, p) in sorted(progress.items()))
            outcome = "not requeued"
            nodes = sorted({node_of(r) for r in behind} - {None})
            if self.requeue:
                from lit_dist.runtime.slurm import job_id, requeue

                exclude = nodes if self.exclude_node and len(nodes) == 1 else []  # only when one node is to blame
                outcome = requeue(exclude=exclude) if job_id() else "not a Slurm job"
            stalled = (f"no optimizer step for {waited:.0f} s (timeout {self.timeout():.0f} s)" if self._armed else
                       f"no first optimizer step {waited:.0f} s after the start of fit (watchdog.startup_timeout_s: "
                       f"{self.timeout():.0f} s)")
            message = f"{stalled}; ranks behind: {names}; {where}; stacks in {os.path.dirname(path)}; {outcome}"
            print(f"lit-dist: hang: {message}", file=sys.stderr, flush=True)
            if self._control is not None:
                self._control.publish(Event("run.hung", "critical", f"Hang at step {self._step + 1}", message,
                                            {"step": self._step, "behind": behind, "host": socket.gethostname(),
                                             "nodes_behind": nodes,
                                             "progress": {str(r): list(v) for r, v in progress.items()},
                                             "waited_s": round(waited, 1), "requeue": outcome}))
                self._control.flush(10.0)
            if store is not None:
                try:  # the others may leave now: this rank said it all (a parent rank's exit ends its children)
                    store.set(f"{_KEY}/told", "1")
                except STORE_ERRORS:
                    pass
        else:
            print(f"lit-dist: hang declared by another rank: rank {rank} stacks in {path}", file=sys.stderr, flush=True)
        if store is not None:
            # Every rank sees the declaration on its next heartbeat and dumps its stacks; a rank holding the
            # interpreter lock dumps from its last resort: leaving before then would break the others'
            # collectives (and the store, if this is rank 0) under them, or kill the children unheard.
            wait = self.last_resort_after_s() + EXIT_AFTER_DUMP_S + 2 * self.heartbeat_s + 1
            _await_end(trainer.default_root_dir, world, None if first else store, time.monotonic() + min(wait, 60.0))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(ExitCode.HUNG))  # the training thread may be stuck in a collective: no unwinding


def _behind(store, world: int, rank: int, step: int, phase: int) -> tuple[list[int], dict[int, tuple[int, int, int]]]:
    """(the ranks least advanced by (collectives issued, step, phase), every rank's progress)."""
    progress = {rank: (compat.collectives_issued(), step, phase)}
    for other in range(world):
        if other == rank or store is None:
            continue
        key = f"{_KEY}/progress/{other}"
        try:  # check first: the store's get waits for a missing key until the store's own timeout
            value = store.get(key).decode().split() if store.check([key]) else None
        except STORE_ERRORS:  # the store went away (its host rank ended): nothing known
            value = None
        # A rank that never published (stuck before its watchdog's first heartbeat) is the least advanced.
        progress[other] = (int(value[0]), int(value[1]), int(value[2])) if value else (-1, -1, 0)
    least = min(progress.values())
    behind = [r for r, p in sorted(progress.items()) if p == least]
    return ([] if len(behind) == len(progress) else behind), progress


def _hang_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "hang", f"rank-{rank}.txt")


def _remove_unused_dumps(prefix: str | None) -> None:
    """Remove the loader workers' dump files that stayed empty (the run did not hang), and the folder if empty."""
    if not prefix:
        return
    folder = os.path.dirname(prefix)
    try:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if path.startswith(prefix + "-worker-pid-") and os.path.getsize(path) == 0:
                os.remove(path)
        os.rmdir(folder)  # only if empty: another rank's dumps, or a hang, keep it
    except OSError:
        pass  # gone meanwhile, or not empty


def _await_end(run_dir: str, world: int, store, deadline: float) -> None:
    """Wait until every rank's hang file holds its stacks and (with ``store``) the declaring rank has said
    everything (its line, its event), or the deadline."""
    while time.monotonic() < deadline:
        try:
            dumped = all(os.path.getsize(_hang_file(run_dir, r)) > 0 for r in range(world))
        except OSError:
            dumped = False  # not made yet: that rank's watchdog had not started
        try:
            told = store is None or store.check([f"{_KEY}/told"])
        except STORE_ERRORS:
            told = True  # the store went with its rank: nobody is left to wait for
        if dumped and told:
            return
        time.sleep(0.2)


def _dump_stacks(path: str, rank: int, step: int, phase: int, waited: float) -> str:
    """Append every thread's Python stack, then its loader workers' states, to the rank's hang file in one write
    (the others take a file that is not empty for a finished dump); returns the path."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # The workers first: their own files are written before this rank's says it is done.
    helpers = dump_helpers(path.removesuffix(".txt"))  # loader workers: a blocked read is in one of them
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"rank {rank} on {socket.gethostname()} (pid {os.getpid()}): last finished step {step}, "
             f"now in step {step + 1}: {PHASES[phase]}; {compat.collectives_issued()} collectives issued; "
             f"no step for {waited:.0f} s\n"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"\nThread {names.get(ident, ident)} (most recent call last):\n")
        lines += traceback.format_stack(frame)
    if helpers:
        lines.append(f"\nThis rank's helper processes (stacks of each loader worker in "
                     f"{os.path.basename(path).removesuffix('.txt')}-worker-pid-PID.txt):\n")
        lines += [f"  {line}\n" for line in helpers]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # the last resort appends to it too
    try:
        os.write(fd, "".join(lines).encode())
    finally:
        os.close(fd)
    return path
