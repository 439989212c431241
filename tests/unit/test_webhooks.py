"""Webhooks against a real HTTP server on 127.0.0.1: delivery, schema, limits, retries, and never blocking."""

import time

import pytest

from lit_dist.callbacks.webhooks import SCHEMA, WebhookNotifier, WebhookSink, discord_payload
from lit_dist.errors import ConfigError
from tests.conftest import lit_dist, quickstart_args
from tests.helpers.http_server import Recorder, self_signed_cert
from tests.helpers.ports import free_port


@pytest.fixture
def server():
    s = Recorder()
    yield s
    s.shutdown()


def notifier(monkeypatch, url, kind="raw", **kwargs):
    monkeypatch.setenv("HOOK_URL", url)
    return WebhookNotifier([WebhookSink(kind=kind, url_env="HOOK_URL", **kwargs.pop("sink", {}))], **kwargs)


def test_events_arrive_in_the_versioned_schema_with_auth_header(server, monkeypatch):
    monkeypatch.setenv("HOOK_TOKEN", "Bearer s3cret")
    n = notifier(monkeypatch, server.url("/ok"), sink={"auth_header_env": "HOOK_TOKEN"})
    n.notify("gpu.fault", "critical", "GPU 3 fault", "ECC", {"uuid": "GPU-1"})
    assert n.flush(5)
    (event,) = server.bodies("/ok")
    assert event["schema"] == SCHEMA and event["type"] == "gpu.fault" and event["data"] == {"uuid": "GPU-1"}
    assert {"run_id", "job_id", "host", "rank", "timestamp", "title", "message", "severity"} <= set(event)
    assert server.requests[0]["headers"]["Authorization"] == "Bearer s3cret"


def test_severity_filter_per_sink(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/ok"), sink={"min_severity": "warning"})
    n.notify("run.progress", "info", "step 5")
    n.notify("gpu.warning", "warning", "hot")
    n.flush(5)
    assert [e["type"] for e in server.bodies("/ok")] == ["gpu.warning"]


def test_discord_messages_stay_within_discord_limits():
    event = {"schema": 1, "type": "run.failed", "severity": "error", "run_id": "r", "job_id": "7", "host": "h",
             "rank": 0, "timestamp": "t", "title": "T" * 500, "message": "M" * 10000,
             "data": {f"k{i}": "v" * 5000 for i in range(40)}}
    payload = discord_payload(event)
    assert len(payload["content"]) <= 2000 and len(payload["embeds"]) <= 10
    embed = payload["embeds"][0]
    assert len(embed["title"]) <= 256 and len(embed["description"]) <= 4096 and len(embed["fields"]) <= 25
    assert all(len(f["value"]) <= 1024 and len(f["name"]) <= 256 for f in embed["fields"])


def test_a_500_is_retried_until_it_succeeds(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/fail-once"))
    n.notify("run.started", "info", "go")
    assert n.flush(10)
    assert server.counts["/fail-once"] == 2 and n.delivered == 1


def test_429_retry_after_is_honoured(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/429-once"))
    n.notify("run.started", "info", "go")
    assert n.flush(10)
    first, second = (r["time"] for r in server.requests)
    assert second - first >= 0.95 and n.delivered == 1


def test_a_stalled_server_never_blocks_training(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/stall"), deadline_s=1.5)
    started = time.monotonic()
    for i in range(20):
        n.notify("run.progress", "info", f"step {i}")
    # A notify that waited for the server would take the 1.5 s deadline at least once; 1 s leaves room for a
    # loaded machine (this bound is the behaviour under test, not a speed claim).
    assert time.monotonic() - started < 1.0, "notify must return at once"
    n.flush(3)
    assert n.failed >= 1


def test_redirects_are_not_followed(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/redirect"))
    n.notify("run.started", "info", "go")
    n.flush(5)
    assert "/target" not in server.counts and n.failed == 1


def test_a_closed_port_fails_within_the_deadline(monkeypatch):
    port = free_port()  # nobody listens: every attempt is refused at once
    monkeypatch.setattr("lit_dist.callbacks.webhooks.random.random", lambda: 0.5)  # backoffs 0.25, 0.5, 1, 2, 4 s
    n = notifier(monkeypatch, f"http://127.0.0.1:{port}/x", deadline_s=2)
    started = time.monotonic()
    n.notify("run.started", "info", "go")
    assert n.flush(10)
    # Given up at 1.75 s, before a wait past the deadline; without the deadline, the five retries take 7.75 s.
    # The bound is the behaviour under test, with room for a loaded machine.
    assert n.failed == 1 and time.monotonic() - started < 5


def test_tls_is_verified_and_a_ca_bundle_can_be_given(tmp_path, monkeypatch):
    cert, key = self_signed_cert(tmp_path)
    server = Recorder(tls_files=(cert, key))
    try:
        untrusted = notifier(monkeypatch, server.url("/ok"))
        untrusted.notify("run.started", "info", "go")
        untrusted.flush(5)
        assert untrusted.failed == 1 and not server.bodies("/ok")
        trusted = notifier(monkeypatch, server.url("/ok"), sink={"ca_bundle": cert})
        trusted.notify("run.started", "info", "go")
        trusted.flush(5)
        assert trusted.delivered == 1 and len(server.bodies("/ok")) == 1
    finally:
        server.shutdown()


def test_a_full_queue_drops_the_oldest_progress_events_and_counts_them(server, monkeypatch):
    n = notifier(monkeypatch, server.url("/stall"), queue_size=3, deadline_s=0.5)
    n.notify("run.started", "info", "start")  # taken by the worker at once, then it stalls
    time.sleep(0.2)
    for i in range(5):
        n.notify("run.progress", "info", f"step {i}")
    n.notify("gpu.fault", "critical", "fault")
    assert n.dropped == 3
    assert [e["type"] for e in n._queue] == ["run.progress", "run.progress", "gpu.fault"]


def test_urls_come_from_env_or_file_and_missing_ones_are_named(monkeypatch, tmp_path):
    monkeypatch.delenv("NOPE_URL", raising=False)
    with pytest.raises(ConfigError, match="url_env = 'NOPE_URL'.*empty or unset"):
        WebhookNotifier([WebhookSink(url_env="NOPE_URL")])
    (tmp_path / "url").write_text("http://127.0.0.1:9/hook\n")
    n = WebhookNotifier([WebhookSink(url_file=str(tmp_path / "url"))])
    assert "127.0.0.1:9" not in repr(n)


@pytest.mark.process
def test_a_real_run_reports_its_events_and_writes_no_secret(server, tmp_path, demo_data):
    url = server.url("/ok") + "?token=TOPSECRET-123"
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, trainer__max_epochs=1,
                                           trainer__enable_progress_bar=False),
                   "--trainer.callbacks+=lit_dist.callbacks.webhooks.WebhookNotifier",
                   "--trainer.callbacks.sinks", '[{"kind": "raw", "url_env": "HOOK_URL", "auth_header_env": "HOOK_TOKEN"}]',
                   env={"HOOK_URL": url, "HOOK_TOKEN": "Bearer TOPSECRET-456"})
    assert out.returncode == 0, out.stderr[-3000:]
    types = [e["type"] for e in server.bodies("/ok")]
    assert types[0] == "run.started" and types[-1] == "run.finished"
    assert "validation.finished" in types and "checkpoint.saved" in types
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"TOPSECRET" not in data, f"a secret leaked into {path}"
    assert "TOPSECRET" not in out.stdout + out.stderr


def test_final_events_get_their_attempt_before_the_flush_ends_whatever_is_stuck_before_them(server, monkeypatch):
    # A sink that holds every request 5 s: the progress event ahead of run.finished takes the sender for
    # longer than the whole flush; run.finished must still be attempted within the flush.
    n = notifier(monkeypatch, server.url("/stall"), deadline_s=15, flush_timeout_s=3)
    n.notify("run.progress", "info", "step 5")
    time.sleep(0.2)  # the sender is now stuck on it
    n.notify("run.progress", "info", "step 6")
    n.notify("run.finished", "info", "done")
    started = time.monotonic()
    n.flush()
    # The flush's own bound is 3 s; one that waited for the stalled post would take 5 s (the behaviour under test).
    assert time.monotonic() - started < 4.5
    assert "run.finished" in [r["body"]["type"] for r in server.requests], "the final event was attempted"


def test_no_backoff_after_the_last_retry(monkeypatch):
    port = free_port()  # nobody listens: every attempt is refused at once
    monkeypatch.setattr("lit_dist.callbacks.webhooks.random.random", lambda: 0.5)  # backoffs 0.25, 0.5, 1 s
    n = notifier(monkeypatch, f"http://127.0.0.1:{port}/x", max_retries=3, deadline_s=30)
    started = time.monotonic()
    n.notify("run.started", "info", "go")
    assert n.flush(10)
    # 1.75 s of waits; a backoff after the last attempt would add 2 s more. The bound, halfway, is the behaviour
    # under test, with a second of room either side for a loaded machine.
    assert n.failed == 1 and time.monotonic() - started < 2.75, "four attempts, three waits, then give up at once"


def test_a_refused_redirect_says_why(server, monkeypatch, caplog):
    n = notifier(monkeypatch, server.url("/redirect"))
    with caplog.at_level("WARNING", logger="lit_dist.callbacks.webhooks"):
        n.notify("run.started", "info", "go")
        n.flush(5)
    assert "HTTP 302 redirect refused" in caplog.text and server.url("/redirect") not in caplog.text
