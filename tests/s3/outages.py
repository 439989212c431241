"""What the S3 outage tests share: storage options that leave the waiting to lit-dist, and the means to end an outage
once lit-dist has waited for the store twice (1 s, then 2 s), rather than after a fixed sleep: when the first request
fails depends on a run's start-up (3 to 10 s on a busy machine), and a sleep long enough for the slowest costs every
run up to 15 s more (lit-dist's waits double: a store back at 15 s is found at the retry at 15 or 31 s)."""

import logging
import os
import signal
import subprocess
import threading
from contextlib import contextmanager

import pytest

from lit_dist.outage import FIRST_WAIT_S

# One attempt per request (botocore's "max_attempts": 1 is one *retry*: a second attempt after a random pause of up
# to a second), short timeouts: botocore's own retries would only lengthen every wait; what is tested is lit-dist's
# wait, which comes on top of whatever the client does.
QUICK = {"config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
# What lit-dist's line says as one request starts its second wait (lit_dist/outage.py): two attempts have failed;
# a store restored on this line answers the third attempt, 2 s later.
SECOND_WAIT = f"; waiting {2 * FIRST_WAIT_S:.0f} s ("
WAITED_TWICE_S = 3 * FIRST_WAIT_S  # what that request has slept before its third attempt


@contextmanager
def restored_on(proxy, text: str = SECOND_WAIT):
    """Restores ``proxy`` (cut by the caller) once lit-dist logs, in this process, a line holding ``text``."""
    logger = logging.getLogger("lit_dist.outage")

    class Restore(logging.Handler):
        done = False

        def emit(self, record):
            if not self.done and text in record.getMessage():
                self.done = True
                proxy.restore()

    handler = Restore()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


class Output:
    """Reads the stdout and stderr of ``proc`` (started with both piped) as they come, in two threads."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines = {"out": [], "err": []}
        self._ended = set()
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, name), daemon=True)
                         for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            with self._changed:
                self.lines[name].append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended.add(name)
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float = 180) -> bool:
        """Whether a line of stderr holds ``text`` before stderr ends or ``timeout`` seconds pass."""
        with self._changed:
            self._changed.wait_for(lambda: "err" in self._ended or any(text in line for line in self.lines["err"]),
                                   timeout)
            return any(text in line for line in self.lines["err"])

    def tail(self) -> str:
        with self._changed:
            return "".join(self.lines["err"])[-3000:]

    def finish(self, timeout: float = 300) -> tuple[int, str, str]:
        """(return code, stdout, stderr), as ``tests.helpers.processes.finish``: on a hang the run's whole session
        is killed and the test fails with the end of its stderr."""
        try:
            self.proc.wait(timeout)
            for reader in self._readers:  # what the run's other processes still hold open ends with them
                reader.join(timeout)
            if any(reader.is_alive() for reader in self._readers):
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for reader in self._readers:
                reader.join(10)
            pytest.fail(f"the run hung:\n{''.join(self.lines['err'])[-5000:]}")
        return self.proc.returncode, "".join(self.lines["out"]), "".join(self.lines["err"])
