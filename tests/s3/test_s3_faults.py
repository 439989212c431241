"""An object store that refuses the credentials, or stops answering: never a bad image, never a bad row.

Each test starts its own S3 server (moto's server mode): one that checks credentials against its IAM
users, one that is stopped in the middle of reading.
"""

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import lit_dist
from tests.helpers.ports import free_port

pytestmark = pytest.mark.s3

IMAGES = 3
BUCKET = "lit-dist-faults"


def start_server(**env) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:  # a connection, not a request: with credentials checked, every request counts (see below)
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.1)


def png(width: int, height: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def guarded():
    """A server that checks credentials after the first requests, which make the bucket, its images and a user
    whose policy lets it list the bucket but not read its objects. Returns (endpoint, that user's keys)."""
    import boto3

    # moto answers its first N requests without checking credentials, then checks every one.
    proc, url = start_server(INITIAL_NO_AUTH_ACTION_COUNT=str(IMAGES + 4))
    admin = dict(endpoint_url=url, aws_access_key_id="admin", aws_secret_access_key="admin", region_name="us-east-1")
    s3, iam = boto3.client("s3", **admin), boto3.client("iam", **admin)
    s3.create_bucket(Bucket=BUCKET)
    for i in range(IMAGES):
        s3.put_object(Bucket=BUCKET, Key=f"imgs/{i}.png", Body=png(40 + i, 20))
    iam.create_user(UserName="lister")
    # AWS authorises ListObjectsV2 by s3:ListBucket; moto from 5.2 checks it as an action of its own.
    listing = ["s3:ListBucket", "s3:ListObjectsV2"]
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": listing, "Resource": "*"}]}
    iam.put_user_policy(UserName="lister", PolicyName="list-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="lister")["AccessKey"]
    yield url, {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_DEFAULT_REGION": "us-east-1"}
    proc.terminate()
    proc.wait(10)


def test_credentials_that_cannot_read_the_images_are_one_data_error_not_a_table_of_bad_rows(tmp_path, guarded):
    url, keys = guarded
    options = json.dumps({"client_kwargs": {"endpoint_url": url}})
    output = tmp_path / "meta.parquet"
    out = lit_dist("index", f"s3://{BUCKET}/imgs", "--output", str(output), "--storage_options", options, env=keys)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"lit-dist: error: cannot read s3://{BUCKET}/imgs/0.png: permission denied (Access Denied). Give this user "
        "read access to the dataset; on an object store check the credentials"), out.stderr[-3000:]
    assert not output.exists()  # no table of 0 x 0 rows, reported later as bad data
    # Keys the server does not know: the listing itself is refused, with the same one message.
    out = lit_dist("index", f"s3://{BUCKET}/imgs", "--output", str(output), "--storage_options", options,
                   env={**keys, "AWS_ACCESS_KEY_ID": "AKIAUNKNOWN0000000000"})
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"cannot read s3://{BUCKET}/imgs: permission denied (The AWS Access Key Id you provided does not exist" \
        in out.stderr


def test_an_object_store_that_stops_answering_is_not_a_bad_image(tmp_path, monkeypatch):
    import numpy as np
    import pyarrow as pa
    import s3fs

    from lit_dist.data.dataset import BucketImageDataset
    from lit_dist.reading.unreadable import BadSample
    from lit_dist.runtime.outage import StoreUnreachable

    proc, url = start_server()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": url}, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        for i in range(IMAGES):
            fs.pipe(f"{BUCKET}/imgs/{i}.png", png(32, 32))
        dataset = BucketImageDataset(f"s3://{BUCKET}/imgs", pa.array([f"{i}.png" for i in range(IMAGES)]),
                                     np.array([[32, 32]]), np.zeros(IMAGES, dtype=np.int64),
                                     storage_options={"client_kwargs": {"endpoint_url": url}, "skip_instance_cache": True},
                                     outage_deadline_s=3)
        assert int(dataset[(0, [0, 1], 1.0)]["bad_samples"]) == 0
    finally:
        proc.terminate()
        proc.wait(10)
    with pytest.raises(StoreUnreachable) as raised:  # the store is gone: waited out, then said so, not 8 "bad images"
        dataset[(0, [2], 1.0)]
    assert not isinstance(raised.value, BadSample)
    assert not dataset._logged, "an outage was logged as an unreadable image and substituted"
