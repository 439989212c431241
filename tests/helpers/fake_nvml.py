"""A test double of pynvml with the same functions, for the GPU circuit breaker.

Readings come from a JSON file named by $FAKE_NVML_STATE, keyed by the LOCAL_RANK of
the process asking (so each rank of a real multi-process run sees "its own" GPU), or by the
Slurm node it runs on (SLURMD_NODENAME; every GPU of that node), which comes first:

    {"1": {"temperature_c": 70, "ecc_after_polls": 3, "ecc": 2}}
    {"node1": {"ecc_after_polls": 3, "ecc": 2}}

``ecc_after_polls``: after that many polls the volatile uncorrectable ECC count becomes
``ecc``; ``throttle``: the throttle-reason bit mask; ``fail_init``: nvmlInit raises.
"""

import json
import os
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
_polls = {"n": 0}


class NVMLError(Exception):
    pass


_cache: dict = {}


def _state() -> dict:
    # Re-read only when the file changes: the double should cost no more than NVML itself.
    path = os.environ["FAKE_NVML_STATE"]
    mtime = os.stat(path).st_mtime_ns
    if _cache.get("mtime") != mtime:
        with open(path) as f:
            _cache.update(mtime=mtime, data=json.load(f))
    data = _cache["data"]
    node = os.environ.get("SLURMD_NODENAME")
    return data[node] if node in data else data.get(os.environ.get("LOCAL_RANK", "0"), {})


def nvmlInit():
    if _state().get("fail_init"):
        raise NVMLError("NVML Shared Library Not Found")


def nvmlDeviceGetHandleByIndex(index):
    _polls["n"] += 1
    return index


def nvmlDeviceGetUUID(handle):
    return f"GPU-fake-{os.environ.get('LOCAL_RANK', '0')}"


def nvmlDeviceGetHandleByUUID(uuid):
    # Like NVML: a UUID it does not know (a real GPU's, beside this double) is NVMLError, "Not Found".
    if uuid != nvmlDeviceGetUUID(None):
        raise NVMLError("Not Found")
    return int(os.environ.get("LOCAL_RANK", "0"))


def nvmlDeviceGetIndex(handle):
    return handle


def nvmlDeviceGetName(handle):
    return "Fake H100"


def nvmlDeviceGetPciInfo(handle):
    return SimpleNamespace(busId=f"0000:{handle + 10:02d}:00.0")


def nvmlDeviceGetTemperature(handle, sensor):
    return _state().get("temperature_c", 60)


def nvmlDeviceGetTemperatureThreshold(handle, kind):
    return _state().get("shutdown_c", 95)


def nvmlDeviceGetPowerUsage(handle):
    return 300_000


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(used=40 * 10**9, total=80 * 10**9)


def nvmlDeviceGetUtilizationRates(handle):
    return SimpleNamespace(gpu=97, memory=50)


def nvmlDeviceGetTotalEccErrors(handle, error_type, counter):
    state = _state()
    after = state.get("ecc_after_polls")
    return state.get("ecc", 0) if after is not None and _polls["n"] > after else 0


def nvmlDeviceGetRetiredPagesPendingStatus(handle):
    return int(_state().get("retired_pending", 0))


def nvmlDeviceGetRemappedRows(handle):
    return (0, 0, 0, int(_state().get("remap_failed", 0)))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle):
    return _state().get("throttle", 0)
