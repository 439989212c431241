"""What the S3 outage tests share: storage options that leave the waiting to lit-dist, and the means to end an outage
once lit-dist has waited for the store twice (1 s, then 2 s), rather than after a fixed sleep: when the first request
fails depends on a run's start-up (3 to 10 s on a busy machine), and a sleep long enough for the slowest costs every
run up to 15 s more (lit-dist's waits double: a store back at 15 s is found at the retry at 15 or 31 s)."""

import logging
from contextlib import contextmanager

from lit_dist.runtime.outage import FIRST_WAIT_S

# One attempt per request (botocore's "max_attempts": 1 is one *retry*: a second attempt after a random pause of up
# to a second), short timeouts: botocore's own retries would only lengthen every wait; what is tested is lit-dist's
# wait, which comes on top of whatever the client does.
QUICK = {"config_kwargs": {"retries": {"total_max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
# What lit-dist's line says as one request starts its second wait (lit_dist/runtime/outage.py): two attempts have failed;
# a store restored on this line answers the third attempt, 2 s later.
SECOND_WAIT = f"; waiting {2 * FIRST_WAIT_S:.0f} s ("
WAITED_TWICE_S = 3 * FIRST_WAIT_S  # what that request has slept before its third attempt


@contextmanager
def restored_on(proxy, text: str = SECOND_WAIT):
    """Restores ``proxy`` (cut by the caller) once lit-dist logs, in this process, a line holding ``text``."""
    logger = logging.getLogger("lit_dist.runtime.outage")

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
