"""An outage of the object store told apart from a bad object, waited out, then "retry later" (the whole runs
against a stopped store are in tests/s3/test_outage.py)."""

import time

import pytest
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

from lit_dist.errors import ExitCode
from lit_dist.runtime import outage


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def s3_answer(code: str, status: int, message: str = "") -> OSError:
    """What s3fs raises for an S3 error answer: its own OSError (by the code), the botocore ClientError as cause."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    return translate_boto_error(ClientError({"Error": {"Code": code, "Message": message or code},
                                             "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"))


def http_answer(status: int) -> Exception:
    """What fsspec's HTTP store raises for an error status (aiohttp's)."""
    from aiohttp import ClientResponseError, RequestInfo
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://store:9000/b/k")
    return ClientResponseError(RequestInfo(url, "GET", CIMultiDictProxy(CIMultiDict()), url), (), status=status,
                               message="answer")


@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(111, "Connection refused"),
    EndpointConnectionError(endpoint_url="http://store:9000/b/k"),
    ReadTimeoutError(endpoint_url="http://store:9000/b/k"),
    TimeoutError("timed out"),
    s3_answer("SlowDown", 503, "Please reduce your request rate."),
    s3_answer("ServiceUnavailable", 503),
    s3_answer("InternalError", 500),
    s3_answer("BadGateway", 502),  # a code s3fs does not know: its OSError(EIO), the status says it
    s3_answer("ThrottlingException", 400),
    http_answer(503),
    http_answer(429),
    chained(RuntimeError("reading failed"), ConnectionResetError(104, "Connection reset by peer")),
])
def test_what_counts_as_an_outage(exc):
    assert outage.is_outage(exc)


@pytest.mark.parametrize("exc", [
    FileNotFoundError(2, "No such file", "b/k.png"),
    PermissionError(13, "Access Denied"),
    s3_answer("NoSuchKey", 404),
    s3_answer("AccessDenied", 403),
    s3_answer("InvalidArgument", 400, "step-000000500 is not a valid part"),  # a 500 among a key's digits
    http_answer(404),
    OSError("cannot identify image file"),
    OSError("An error occurred (503) when calling the GetObject operation"),  # words only: no answer to read
    ValueError("bad value"),
])
def test_a_missing_or_bad_object_is_not_an_outage(exc):
    assert not outage.is_outage(exc)


def test_a_short_outage_is_waited_out_and_the_same_object_read(monkeypatch):
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.01)
    answers = [ConnectionRefusedError(111, "refused"), ConnectionRefusedError(111, "refused"), b"the bytes"]

    def read():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert outage.call(read, "b/k.png", deadline_s=5) == b"the bytes" and not answers


def test_an_outage_past_its_deadline_says_retry_later_and_other_errors_pass_through(monkeypatch):
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.01)

    def refused():
        raise ConnectionRefusedError(111, "refused")

    with pytest.raises(outage.StoreUnreachable, match=r"^rank 1: the object store did not answer for .* reading "
                       r"b/k.png .*retry the job later") as caught:
        outage.call(refused, "b/k.png", deadline_s=0.1, who="rank 1: ")
    assert caught.value.exit_code == ExitCode.STORE_UNREACHABLE == 17

    def missing():
        raise FileNotFoundError(2, "No such file")

    with pytest.raises(FileNotFoundError):  # not waited for: the object is missing, the store answered
        outage.call(missing, "b/k.png", deadline_s=5)



def test_the_deadline_counts_from_the_first_failure_so_a_long_upload_cut_short_is_retried(monkeypatch):
    monkeypatch.setattr(outage, "FIRST_WAIT_S", 0.01)
    attempts = []

    def upload():
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            time.sleep(0.3)  # uploading for longer than the whole deadline, then the connection is reset
            raise ConnectionResetError(104, "Connection reset by peer")
        return "uploaded"

    assert outage.call(upload, "step 5 to s3://b/ckpt/step-000000005", 0.2, verb="saving") == "uploaded"
    assert len(attempts) == 2

    def refused():
        raise ConnectionRefusedError(111, "refused")

    with pytest.raises(outage.StoreUnreachable, match=r"^the object store did not answer for .* saving step 5 to "
                       r"s3://b/ckpt/step-000000005 .*\(checkpoint.outage_deadline_s: 0 s\)$"):
        outage.call(refused, "step 5 to s3://b/ckpt/step-000000005", 0.1, verb="saving",
                    knob="checkpoint.outage_deadline_s")
