"""``WebhookNotifier``: run events to Discord and to orchestrators (raw JSON), never blocking training.

Example (YAML; URLs and tokens come from environment variables or files, never from here)::

    trainer:
      callbacks:
        - class_path: lit_dist.callbacks.webhooks.WebhookNotifier
          init_args:
            sinks:
              - {kind: discord, url_env: DISCORD_WEBHOOK_URL, min_severity: warning}
              - {kind: raw, url_env: ORCHESTRATOR_URL, auth_header_env: ORCHESTRATOR_TOKEN}

The notifier is a subscriber of the run control's event publisher (``lit_dist.runtime.control``): it
sends what is published there (schema 1, see docs/webhooks.md): ``run.started``, ``run.progress``,
``validation.finished``, ``run.finished``, ``run.failed`` and ``run.preempted`` from rank 0,
``checkpoint.saved`` from rank 0 once the checkpoint is complete, ``samples.written`` from rank 0 once a
sample grid is written (lit_dist.callbacks.samples), ``gpu.warning`` and ``gpu.fault``
from the rank whose GPU it is, ``run.hung`` from the first rank whose hang watchdog noticed.

Delivery runs on a background thread with a bounded queue: a post has a total deadline,
retries with exponential backoff and jitter, honours ``429 Retry-After``, never follows a
redirect (headers such as the auth token would go along), and verifies TLS. A full queue
drops the oldest progress event first and counts it. At the end of the run (or on an
error) the queue is flushed within ``flush_timeout_s``; the final and fault events (``run.finished``,
``run.failed``, ``run.preempted``, ``run.hung``, ``gpu.fault``) are sent at once on their own thread, whatever
is still queued or stuck before them, so they get their attempt before the flush ends.
"""

import collections
import json
import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from lightning.pytorch import Callback

from lit_dist.errors import ConfigError
from lit_dist.runtime.control import Event, RunControl

log = logging.getLogger(__name__)

SCHEMA = 1
SEVERITIES = ("info", "warning", "error", "critical")
# Sent first when the run ends, past whatever is queued before them (see flush).
FINAL = ("run.finished", "run.failed", "run.preempted", "run.hung", "gpu.fault")
DISCORD_COLOURS = {"info": 0x3498DB, "warning": 0xF1C40F, "error": 0xE74C3C, "critical": 0x8E44AD}


@dataclass
class WebhookSink:
    """One destination of events.

    Args:
        kind: discord (message text and embeds) or raw (the versioned JSON event, for orchestrators).
        url_env: Environment variable that holds the URL (the URL itself never goes in a config).
        url_file: Or a file whose first line is the URL.
        auth_header_env: raw: environment variable whose value is sent as the Authorization header.
        min_severity: Send only events at least this severe: info, warning, error or critical.
        ca_bundle: CA bundle (PEM) to verify the server's TLS certificate with; default: the system's.
    """

    kind: str = "raw"
    url_env: str | None = None
    url_file: str | None = None
    auth_header_env: str | None = None
    min_severity: str = "info"
    ca_bundle: str | None = None

    def resolve_url(self, where: str) -> str:
        if self.kind not in ("discord", "raw"):
            raise ConfigError(f"{where}.kind = {self.kind!r}: use discord or raw")
        if self.min_severity not in SEVERITIES:
            raise ConfigError(f"{where}.min_severity = {self.min_severity!r}: use one of {', '.join(SEVERITIES)}")
        if self.url_env:
            url = os.environ.get(self.url_env, "").strip()
            if not url:
                raise ConfigError(f"{where}.url_env = {self.url_env!r}, but that environment variable is empty or unset. "
                                  f"Export it (export {self.url_env}=https://...) before starting the run.")
            return url
        if self.url_file:
            try:
                with open(self.url_file) as f:
                    return f.readline().strip()
            except OSError as exc:
                raise ConfigError(f"{where}.url_file = {self.url_file!r}: cannot read it ({exc})") from exc
        raise ConfigError(f"{where}: set url_env (an environment variable) or url_file; URLs never go in the config")


class WebhookNotifier(Callback):
    """Sends the run control's events to every configured sink from a background thread."""

    def __init__(
        self,
        sinks: list[WebhookSink] | None = None,
        sinks_file: str | None = None,
        deadline_s: float = 15.0,
        max_retries: int = 5,
        queue_size: int = 256,
        flush_timeout_s: float = 10.0,
    ):
        """Configure the webhooks.

        Args:
            sinks: Destinations, each with kind, url_env or url_file, min_severity.
            sinks_file: Or a webhooks.json file holding a list of sinks in the same form.
            deadline_s: Total time one event may take to deliver, retries and waits included.
            max_retries: Attempts after the first for a 5xx, a 429 or a network error.
            queue_size: Events waiting at most; beyond it the oldest progress event is dropped.
            flush_timeout_s: At the end of the run, how long to wait for the queue to drain.
        """
        specs = list(sinks or [])
        if sinks_file:
            try:
                with open(sinks_file) as f:
                    specs += [WebhookSink(**entry) for entry in json.load(f)]
            except (OSError, ValueError, TypeError) as exc:
                raise ConfigError(f"sinks_file = {sinks_file!r}: cannot read a list of sinks from it ({exc})") from exc
        self._sinks = [(s, s.resolve_url(f"sinks[{i}]")) for i, s in enumerate(specs)]
        self.deadline_s = deadline_s
        self.max_retries = max_retries
        self.queue_size = queue_size
        self.flush_timeout_s = flush_timeout_s
        self.dropped = 0  # progress events dropped because the queue was full
        self.failed = 0  # events a sink did not accept within the deadline
        self.delivered = 0
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = 0
        self._thread: threading.Thread | None = None
        self._context = {"run_id": os.environ.get("LIT_DIST_RUN_ID"), "job_id": os.environ.get("SLURM_JOB_ID"),
                         "host": socket.gethostname(), "rank": int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))}

    def __repr__(self) -> str:  # never show the URLs
        return f"WebhookNotifier({len(self._sinks)} sinks)"

    # -- events -----------------------------------------------------------------------------

    def notify(self, type: str, severity: str, title: str, message: str = "", data: dict | None = None,
               timestamp: str | None = None) -> None:
        """Queue an event for every sink whose min_severity it meets. Never blocks, never raises."""
        event = {"schema": SCHEMA, "type": type, "severity": severity, **self._context,
                 "timestamp": timestamp or datetime.now(timezone.utc).isoformat(), "title": title, "message": message,
                 "data": data or {}}
        with self._cond:
            if len(self._queue) >= self.queue_size:
                progress = next((e for e in self._queue if e["type"] == "run.progress"), None)
                if progress is None and type == "run.progress":
                    self.dropped += 1
                    return
                self._queue.remove(progress if progress is not None else self._queue[0])
                self.dropped += 1
            self._queue.append(event)
            self._cond.notify()
        self._start()

    def send(self, event: Event) -> None:
        """The run control's subscription: queue a published event."""
        self.notify(event.type, event.severity, event.title, event.message, event.data, event.timestamp)

    def connect(self, control: RunControl) -> None:
        control.subscribe(self)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._context["rank"] = trainer.global_rank
        self._context["run_id"] = os.environ.get("LIT_DIST_RUN_ID") or self._context["run_id"]

    # -- delivery ---------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued event was delivered or given up on; False if the timeout came first.

        The final and fault events in the queue do not wait behind the others (a failing sink can hold
        one event for deadline_s, longer than the flush): they are posted at once on their own thread,
        each within the time the flush has left.
        """
        deadline = time.monotonic() + (self.flush_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            final = [e for e in self._queue if e["type"] in FINAL]
            for event in final:
                self._queue.remove(event)
            if final:
                self._busy += 1
        if final:
            threading.Thread(target=self._deliver_all, args=(final, deadline), name="lit-dist-webhooks-final",
                             daemon=True).start()
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("lit-dist: %d webhook events not delivered before the flush timeout", len(self._queue))
                    return False
                self._cond.wait(left)
        return True

    def _deliver_all(self, events: list[dict], deadline: float) -> None:
        import requests

        session = requests.Session()
        try:
            for event in events:
                self._deliver(session, event, deadline)
        finally:
            self._done()

    def _done(self) -> None:
        """One sender finished its work: a flush waiting for it may end."""
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lit-dist-webhooks", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import requests

        session = requests.Session()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                event = self._queue.popleft()
                self._busy += 1
            try:
                self._deliver(session, event)
            finally:
                self._done()

    def _deliver(self, session, event: dict, deadline: float | None = None) -> None:
        """Post ``event`` to every sink that wants it; each post within deadline_s (and ``deadline``)."""
        for index, (sink, url) in enumerate(self._sinks):
            if SEVERITIES.index(event["severity"]) < SEVERITIES.index(sink.min_severity):
                continue
            until = time.monotonic() + self.deadline_s
            why = self._post(session, sink, url, event, until if deadline is None else min(until, deadline))
            if why is None:
                self.delivered += 1
            else:
                self.failed += 1
                log.warning("lit-dist: webhook sink %d (%s) did not take event %s: %s", index, sink.kind, event["type"], why)

    def _post(self, session, sink: WebhookSink, url: str, event: dict, deadline: float) -> str | None:
        """Deliver one event to one sink by ``deadline``: None when it was taken, else why not."""
        import requests

        body = discord_payload(event) if sink.kind == "discord" else event
        headers = {"Content-Type": "application/json"}
        if sink.kind == "raw" and sink.auth_header_env and os.environ.get(sink.auth_header_env):
            headers["Authorization"] = os.environ[sink.auth_header_env]
        why = "no attempt before the deadline"
        for attempt in range(self.max_retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                return why
            wait = None
            try:
                # requests' timeout bounds each read, not the whole post: cap both by the time left.
                response = session.post(url, data=json.dumps(body), headers=headers, allow_redirects=False,
                                        verify=sink.ca_bundle or True, timeout=(min(5.0, left), left))
                code = response.status_code
                if 200 <= code < 300:
                    return None
                if 300 <= code < 400:  # the URL never goes to the log: it is a secret
                    return (f"HTTP {code} redirect refused: lit-dist never follows redirects (the Authorization "
                            "header would go along to the new address); configure the final URL")
                why = f"HTTP {code}"
                if code == 429:
                    wait = _retry_after(response.headers.get("Retry-After"))
                elif code < 500:  # 4xx: retrying will not help
                    return why
            except requests.exceptions.SSLError as exc:
                return f"TLS verification failed ({type(exc).__name__}); set ca_bundle for a private CA"
            except requests.RequestException as exc:
                why = f"{type(exc).__name__}"
            if attempt == self.max_retries:
                return f"{why} after {attempt + 1} attempts"  # no backoff after the last one: nothing follows it
            if wait is None:
                wait = min(8.0, 0.25 * 2**attempt) * (0.5 + random.random())  # exponential backoff, jittered
            if time.monotonic() + wait > deadline:
                return f"{why}; the deadline came before the next retry"
            time.sleep(wait)
        return why


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return 1.0


def discord_payload(event: dict) -> dict:
    """A Discord message: content <= 2000 characters, one embed, <= 25 fields of <= 1024 characters."""
    fields = [{"name": str(k)[:256], "value": str(v)[:1024], "inline": True}
              for k, v in list(event["data"].items())[:22]]
    fields += [{"name": "rank", "value": str(event["rank"]), "inline": True},
               {"name": "host", "value": str(event["host"])[:1024], "inline": True}]
    if event.get("job_id"):
        fields.append({"name": "Slurm job", "value": str(event["job_id"]), "inline": True})
    content = f"**{event['title']}** ({event['type']}, run {event['run_id']})"
    return {
        "content": content[:2000],
        "embeds": [{"title": event["title"][:256], "description": (event["message"] or event["type"])[:4096],
                    "color": DISCORD_COLOURS[event["severity"]], "timestamp": event["timestamp"], "fields": fields[:25]}],
    }
