"""Which ranks went away, asked of the job's rendezvous store when a collective failed because a peer vanished.

Under srun or torchrun a rank cannot see how its peers ended: they are not its children (under Lightning's own
launcher, rank 0 is the others' parent and reads their exit status: ``lit_dist.runtime.processes.ChildRanks``). What
every rank of a job can reach is the rendezvous store its process group was made with (a TCPStore). So:

- at the start of fit, each rank's watchdog thread registers who it is (``lit-dist/rank/N/who``: host and pid)
  and, every heartbeat, adds one to ``lit-dist/rank/N/beats``;
- a rank whose collective broke because a peer went away (gloo: "Connection reset by peer") answers the roll
  call (``lit-dist/rank/N/here``) and watches the others for a while: a rank is alive once it answered or its
  beats moved on (a live rank in a long forward has not reached a collective yet, but its watchdog beats), and
  gone at once if it registered on this host and its process has ended; the ranks on other hosts that did
  neither are gone after ``1.5 x heartbeat + 1`` seconds (about 8.5 s by default). Every rank that broke out of
  a collective answers within moments of the first, so the wait ends as soon as every rank is accounted for.
- The store is hosted by torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``) or else by rank 0's own process:
  there, a store that stops answering before rank 0 answered means rank 0 went away, and rank 0 stays until
  every rank it counted alive has read what it needed (``lit-dist/rank/N/done``, at most a few seconds).

Reads never block: a TCPStore ``get`` of a missing key waits until the store's own timeout, so keys are read with
``check`` and counters with ``add(key, 0)``.
"""

import logging
import os
import re
import signal
import socket
import threading
import time

from lit_dist.runtime.processes import ProcessDied, alive

log = logging.getLogger(__name__)

_KEY = "lit-dist/rank"
_DEFAULT_WAIT_S = 10.0  # without the watchdog (no beats): how long the ranks left have to answer
_interval_s: float | None = None  # this rank's heartbeat, once registered


# What a TCPStore request raises when the store cannot answer: torch's DistStoreError and DistNetworkError are
# RuntimeErrors; a refused or reset connection can surface as an OSError; a garbled value as a ValueError.
STORE_ERRORS = (RuntimeError, OSError, ValueError)


def rendezvous_store():
    """The process group's rendezvous store (a TCPStore client of its own connection), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no process group, or torch renamed it
        return None


def register(store, rank: int, heartbeat_s: float) -> None:
    """Say who this rank is (its host and pid); called once by the watchdog thread, before its first beat."""
    global _interval_s
    _interval_s = heartbeat_s
    store.set(f"{_KEY}/{rank}/who", f"{socket.gethostname()} {os.getpid()}")


def beat(store, rank: int) -> None:
    """One heartbeat of this rank (the watchdog thread, every ``heartbeat_s``)."""
    store.add(f"{_KEY}/{rank}/beats", 1)


def _who(store, rank: int) -> tuple[str, int] | None:
    """(host, pid) that ``rank`` registered, else None."""
    key = f"{_KEY}/{rank}/who"
    try:
        if store.check([key]):
            host, pid = store.get(key).decode().split()
            return host, int(pid)
    except STORE_ERRORS:
        pass
    return None


def _name(rank: int, who: tuple[str, int] | None) -> str:
    return f"rank {rank} (pid {who[1]} on {who[0]})" if who else f"rank {rank}"


def _ended_here(who: tuple[str, int] | None) -> bool:
    """Whether a rank registered on this host has ended (no such process, or a zombie): known at once, no wait."""
    return who is not None and who[0] == socket.gethostname() and not alive(who[1])


def _store_host_is_rank_0() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def gone(rank: int, world: int, store=None) -> str | None:
    """After a collective broke because a peer went away: answer the roll call, watch the others, and return
    who is gone ("rank 1 (pid 4242 on node-b)", joined with "and"), or None where the store cannot tell.

    From here the process is on its way out: SIGTERM is ignored, since the launcher (torchrun, srun) sends it
    to the ranks left as soon as it sees one fail, which would cut this short; it follows with SIGKILL after
    its grace period (30 s), longer than this takes."""
    store = store or rendezvous_store()
    if store is None or world < 2:
        return None
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    others = [r for r in range(world) if r != rank]
    wait_s = 1.5 * _interval_s + 1.0 if _interval_s else _DEFAULT_WAIT_S
    alive: set[int] = set()
    try:
        store.set(f"{_KEY}/{rank}/here", "1")
        who = {r: _who(store, r) for r in others}
        ended = {r for r in others if _ended_here(who[r])}
        beats = {r: store.add(f"{_KEY}/{r}/beats", 0) for r in others}
        deadline = time.monotonic() + wait_s
        while len(alive) + len(ended) < len(others) and time.monotonic() < deadline:
            for r in others:
                if r in alive or r in ended:
                    continue
                if store.check([f"{_KEY}/{r}/here"]) or store.add(f"{_KEY}/{r}/beats", 0) > beats[r]:
                    alive.add(r)
                elif _ended_here(who[r]):
                    ended.add(r)
            time.sleep(0.2)
        names = " and ".join(_name(r, who[r]) for r in others if r not in alive)
        store.set(f"{_KEY}/{rank}/done", "1")
        if rank == 0 and _store_host_is_rank_0():
            _linger(store, sorted(alive))
    except STORE_ERRORS as exc:
        log.debug("lit-dist: roll call: the store stopped answering (%s)", exc)
        if rank != 0 and 0 not in alive and _store_host_is_rank_0():
            return "rank 0 (which held the job's rendezvous store)"
        return None
    return names or None


def _linger(store, ranks: list[int], bound_s: float = 5.0) -> None:
    """Rank 0 holds the store: keep it up until the ranks it counted alive have finished their roll call."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and not all(store.check([f"{_KEY}/{r}/done"]) for r in ranks):
        time.sleep(0.1)

# What a collective raises on the ranks left when another process of the run went away mid-collective.
_PEER_LOST = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe|Remote process exited")


def peer_lost(exc: BaseException, rank: int, world: int = 1) -> ProcessDied | None:
    """A ProcessDied for a collective that failed because a peer process went away, else None. Under srun or
    torchrun this rank cannot see how the peer ended; it names the ranks that stopped answering the job's
    rendezvous store (``gone``), and the launcher's own lines say how they ended."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and (match := _PEER_LOST.search(str(exc))):
            lost = gone(rank, world)
            who = f"{lost} went away" if lost else "another process of the run went away"
            return ProcessDied(f"rank {rank}: a collective failed because {who} ({match.group(0)}); the launcher's "
                               "log says how it ended (torchrun: 'failed (exitcode: -9) local_rank: N', srun: 'task "
                               "N: Killed'); resume the run from its last checkpoint")
        exc = exc.__cause__ or exc.__context__
    return None
