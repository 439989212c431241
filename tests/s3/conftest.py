"""A real S3-compatible server (moto's server mode, as s3fs's own tests use) on 127.0.0.1."""

import os
import subprocess
import sys
import time

import pytest
import requests

from tests.helpers.ports import free_port


@pytest.fixture(scope="session")
def s3_endpoint():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            # moto loads its backends on the first request: several seconds on a busy machine (a read timeout,
            # not a refused connection, so both mean "not ready yet").
            requests.get(url, timeout=(1, 10))
            break
        except (requests.ConnectionError, requests.Timeout):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the moto S3 server did not start (is moto[server] installed? bash .ci/setup test)") from None
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """An s3fs filesystem on the local server with a fresh bucket; credentials come from the environment."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    bucket = f"lit-dist-{os.getpid()}-{time.monotonic_ns()}"
    fs.mkdir(bucket)
    fs.bucket = bucket
    fs.endpoint = s3_endpoint
    yield fs
    fs.rm(bucket, recursive=True)
