"""The roll call of the ranks left after a peer went away, on a real TCPStore: a rank on this host whose process
ended is named at once, a rank elsewhere that neither answers nor beats is named after the wait, and a rank that
answers or whose watchdog beats is alive."""

import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed import TCPStore

from lit_dist.runtime import roll_call
from tests.helpers.ports import free_port

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def sigterm_kept():
    """The roll call ignores SIGTERM for the rest of a leaving process's life; pytest's own stays."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    yield server
    del server


def ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_rank_on_this_host_whose_process_ended_is_named_at_once(store):
    roll_call.register(store, 0, heartbeat_s=30.0)  # a long wait: only the process check can end it early
    store.set("lit-dist/rank/1/who", f"{roll_call.socket.gethostname()} {ended_pid()}")
    started = time.monotonic()
    named = roll_call.gone(0, 2, store)
    assert time.monotonic() - started < 2.0
    assert named is not None and named.startswith("rank 1 (pid ") and roll_call.socket.gethostname() in named


def test_ranks_that_answer_or_beat_are_alive_and_a_silent_one_elsewhere_is_named_after_the_wait(store):
    roll_call.register(store, 1, heartbeat_s=0.4)  # wait: 1.5 x 0.4 + 1 = 1.6 s
    store.set("lit-dist/rank/3/who", "node-b 4242")
    store.set("lit-dist/rank/0/here", "1")  # rank 0 broke out of its collective too
    beating = threading.Event()

    def rank_2_in_a_long_forward():  # no collective reached yet, but its watchdog beats
        while not beating.wait(0.2):
            roll_call.beat(store, 2)

    thread = threading.Thread(target=rank_2_in_a_long_forward)
    thread.start()
    try:
        started = time.monotonic()
        named = roll_call.gone(1, 4, store)
        waited = time.monotonic() - started
    finally:
        beating.set()
        thread.join()
    assert named == "rank 3 (pid 4242 on node-b)"
    assert 1.5 < waited < 3.0, waited


def test_nobody_is_named_when_every_other_rank_answers(store):
    roll_call.register(store, 1, heartbeat_s=5.0)
    store.set("lit-dist/rank/0/here", "1")
    started = time.monotonic()
    assert roll_call.gone(1, 2, store) is None
    assert time.monotonic() - started < 1.0
