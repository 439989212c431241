"""A network that drops an object store's packets without a word (the real local S3 server behind a proxy that
holds every connection and forwards nothing): each request fails within lit-dist's bounds, so the outage
deadline is what the user waits, not botocore's defaults (60 s per attempt, up to 5 attempts, 5 tries by s3fs)."""

import time
from urllib.parse import urlparse

import pytest

from lit_dist.runtime import outage
from tests.helpers.tcp_proxy import TcpProxy

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(s3):
    endpoint = urlparse(s3.endpoint)
    proxy = TcpProxy((endpoint.hostname, endpoint.port))
    yield proxy
    proxy.close()


def test_a_silent_store_is_unreachable_within_the_deadline_and_one_bounded_request(s3, proxy):
    s3.pipe(f"{s3.bucket}/image.png", b"x" * 100)
    # The read timeout given short, as a user may; lit-dist fills in the rest (one attempt per request, two tries).
    fs, path = outage.url_to_fs(f"s3://{s3.bucket}/image.png", client_kwargs={"endpoint_url": proxy.url},
                                config_kwargs={"read_timeout": 2}, skip_instance_cache=True)
    assert fs.cat_file(path) == b"x" * 100
    proxy.silence()
    started = time.monotonic()
    with pytest.raises(outage.StoreUnreachable, match="the object store did not answer for"):
        outage.call(lambda: fs.cat_file(path), path, deadline_s=3)
    # The deadline counts from the first failed request; then at most one more: each is two tries of 2 s.
    assert time.monotonic() - started < 2 * 2 + 3 + 2 * 2 + 3, time.monotonic() - started
    proxy.restore()
    assert fs.cat_file(path) == b"x" * 100


def test_lit_dist_s_request_bounds_fill_in_only_what_the_storage_options_leave_out(s3):
    fs, _ = outage.url_to_fs(f"s3://{s3.bucket}/x", client_kwargs={"endpoint_url": s3.endpoint},
                             config_kwargs={"read_timeout": 7}, skip_instance_cache=True)
    config = fs.connect().meta.config if hasattr(fs, "connect") else fs.s3.meta.config
    assert (config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]) == (5, 7, 1)
    assert fs.retries == outage.S3_READ_TRIES
