"""An object store that cannot be reached is an outage, not a bad file: wait it out, then say "retry later".

Reading data, a cache or a checkpoint from S3 (or any fsspec store), a refused connection, a timeout, a 5xx or a
throttling answer says nothing about the object: replacing the sample by another of its bucket, as for an image
that does not decode, would train on substitutes for as long as the store is away. ``call`` retries such a read
with exponential backoff (1 s doubling to 30 s), saying once per attempt-series what it waits for, until a
deadline (``data.outage_deadline_s``; ``checkpoint.outage_deadline_s`` for checkpoints, whose uploads, listings
and deletions are retried the same way); a short outage costs only its length, and the same object is read. The
deadline counts from the first failed attempt, so a long upload that the outage interrupts is still retried. Past
the deadline it raises ``StoreUnreachable`` (exit 17: the job may be retried later, as is).
"""

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from lit_dist.errors import ExitCode, LitDistError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEADLINE_S = 180.0  # the default of data.outage_deadline_s (and of reads that have no knob of their own)
FIRST_WAIT_S = 1.0
LONGEST_WAIT_S = 30.0
# Error codes of an S3 answer that is the store's trouble, not the object's (S3 and its look-alikes); any 5xx status
# and 429 (too many requests) are too.
_SERVER_TROUBLE = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                   "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "RequestTimeTooSkewed"}


# Each request to an S3 store, unless the storage options say otherwise: a network that drops packets without a word
# holds a request until these run out (botocore's defaults: 60 s each, up to 5 attempts, and s3fs tries a timed-out
# read 5 times), before the outage deadline above is even looked at. One attempt per request: ``call`` retries.
S3_REQUEST = {"connect_timeout": 5, "read_timeout": 20, "retries": {"total_max_attempts": 1}}
S3_READ_TRIES = 2  # s3fs's own tries of a read that timed out or was torn (its default: 5)


def url_to_fs(url: str, **storage_options):
    """``fsspec.core.url_to_fs`` with lit-dist's bounds on one request to an S3 store (``S3_REQUEST``, each key
    only where the storage options' ``config_kwargs`` lack it): a silent network fails a request within 5 s
    (connecting) or 40 s (a read), and ``call`` takes it from there."""
    import fsspec

    s3 = url.split("://", 1)[0] in ("s3", "s3a")
    if s3:
        storage_options["config_kwargs"] = {**S3_REQUEST, **(storage_options.get("config_kwargs") or {})}
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if s3 and isinstance(getattr(fs, "retries", None), int):
        fs.retries = min(fs.retries, S3_READ_TRIES)
    return fs, path


class StoreUnreachable(LitDistError):
    """The object store did not answer for the whole outage deadline."""

    exit_code = ExitCode.STORE_UNREACHABLE


def _connection_types() -> tuple[type, ...]:
    types: list[type] = [ConnectionError, TimeoutError]
    try:
        from botocore import exceptions as boto

        types += [boto.ConnectionError, boto.HTTPClientError]  # refused, DNS, connect/read timeouts, closed
    except ImportError:
        pass
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError]
    except ImportError:
        pass
    return tuple(types)


def _server_trouble(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's answer that it is in trouble itself, read from the answer's status and code
    (never from the message, where a key's digits or a word can look like one): botocore's ``ClientError`` (which
    s3fs raises as the cause of its ``OSError``) or aiohttp's ``ClientResponseError`` (fsspec's HTTP store)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore.exceptions.ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return response.get("Error", {}).get("Code") in _SERVER_TROUBLE or _trouble_status(status)
    status = getattr(exc, "status", None)
    return type(exc).__name__ == "ClientResponseError" and _trouble_status(status)


def _trouble_status(status) -> bool:
    return isinstance(status, int) and (status >= 500 or status == 429)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the store could not be reached or answered for itself, not the
    object: a connection refused or reset, a timeout, a 5xx or throttling answer."""
    connection = _connection_types()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, connection) or _server_trouble(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def call(read: Callable[[], T], what: str, deadline_s: float, who: str = "", verb: str = "reading",
         knob: str = "data.outage_deadline_s") -> T:
    """``read()``, retried through an outage of the store for up to ``deadline_s`` seconds from its first failure;
    ``who`` starts each line (e.g. "rank 1: "), ``verb`` and ``what`` say what was being done ("saving", "step 12 to
    s3://b/ckpt/step-000000012"), ``knob`` is the setting that holds the deadline."""
    # A loop of its own rather than tenacity's: its stop_after_delay and stop_before_delay count from the first
    # attempt, so an upload that failed after running longer than the deadline would never be retried; here the
    # deadline counts from the first failure, and each wait says how long so far.
    started = None  # the first failure: a long upload cut short is retried however long it ran
    wait = FIRST_WAIT_S
    while True:
        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - only an outage is kept (is_outage); anything else is raised as is
            if not is_outage(exc):
                raise
            started = time.monotonic() if started is None else started
            waited = time.monotonic() - started
            if waited + wait > deadline_s:
                raise StoreUnreachable(f"{who}the object store did not answer for {waited:.0f} s {verb} {what} "
                                       f"({type(exc).__name__}: {exc}); retry the job later ({knob}: "
                                       f"{deadline_s:.0f} s)") from exc
            log.warning("lit-dist: %sthe object store does not answer (%s: %s) %s %s; waiting %.0f s (%.0f of "
                        "%.0f s so far)", who, type(exc).__name__, exc, verb, what, wait, waited, deadline_s)
            time.sleep(wait)
            wait = min(wait * 2, LONGEST_WAIT_S)
