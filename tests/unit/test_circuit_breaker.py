import json
import logging
from types import SimpleNamespace

import pytest
import torch

from lit_dist.callbacks.circuit_breaker import HW_SLOWDOWN, POWER_BRAKE, THERMAL_SLOWDOWN, Judge, Reading
from lit_dist.errors import ConfigError


def judge():
    return Judge(ecc_threshold=0, margin_c=5, throttle_polls=3)


def test_any_new_volatile_uncorrectable_ecc_error_trips():
    j = judge()
    assert j(Reading(0, ecc_uncorrectable=4)) == (None, None), "errors before the start are the baseline"
    assert j(Reading(0, ecc_uncorrectable=5))[0] == "1 new volatile uncorrectable ECC errors"


def test_retired_pages_row_remap_and_temperature_trip():
    assert "retired pages" in judge()(Reading(0, retired_pending=True))[0]
    assert "row remapping" in judge()(Reading(0, remap_failed=True))[0]
    assert judge()(Reading(0, temperature_c=89, shutdown_c=95))[0] is None
    assert "within 5" in judge()(Reading(0, temperature_c=90, shutdown_c=95))[0]


def test_throttling_must_persist_and_thermal_slowdown_only_warns():
    j = judge()
    assert j(Reading(0, throttle=HW_SLOWDOWN))[0] is None
    assert j(Reading(0, throttle=HW_SLOWDOWN))[0] is None
    assert j(Reading(0, throttle=0))[0] is None, "a clean poll resets the count"
    for _ in range(2):
        assert j(Reading(0, throttle=POWER_BRAKE))[0] is None
    assert "power-brake" in j(Reading(0, throttle=POWER_BRAKE))[0]
    assert judge()(Reading(0, throttle=THERMAL_SLOWDOWN)) == (None, "thermal slowdown")


@pytest.mark.process
def test_without_nvml_the_breaker_says_so_once_and_training_goes_on(tmp_path, demo_data):
    import json

    from tests.conftest import lit_dist, quickstart_args

    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"0": {"fail_init": True}}))
    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, data__batch_size_per_device=8, trainer__max_epochs=1,
                                           trainer__enable_progress_bar=False),
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0",
                   env={"FAKE_NVML_STATE": str(state)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("GPUCircuitBreaker disabled: NVML unavailable") == 1


def test_cuda_errors_are_classified_hardware_or_not():
    import pytest

    from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker, GPUFault

    breaker = GPUCircuitBreaker()
    trainer = type("T", (), {"callbacks": []})()
    with pytest.raises(GPUFault, match="illegal memory access"):
        breaker.on_exception(trainer, None, RuntimeError("CUDA error: an illegal memory access was encountered"))
    for benign in ("CUDA out of memory. Tried to allocate 2.00 GiB", "NCCL watchdog thread terminated: timed out"):
        assert breaker.on_exception(trainer, None, RuntimeError(benign)) is None


def test_sinks_can_come_from_a_webhooks_json_file(tmp_path, monkeypatch):
    import json

    import pytest

    from lit_dist.callbacks.webhooks import WebhookNotifier
    from lit_dist.errors import ConfigError

    monkeypatch.setenv("HOOK_A", "http://127.0.0.1:9/a")
    path = tmp_path / "webhooks.json"
    path.write_text(json.dumps([{"kind": "discord", "url_env": "HOOK_A", "min_severity": "error"}]))
    notifier = WebhookNotifier(sinks_file=str(path))
    assert [(s.kind, s.min_severity) for s, _ in notifier._sinks] == [("discord", "error")]
    path.write_text(json.dumps([{"kind": "carrier-pigeon", "url_env": "HOOK_A"}]))
    with pytest.raises(ConfigError, match="kind = 'carrier-pigeon'"):
        WebhookNotifier(sinks_file=str(path))


def test_the_watched_gpu_is_found_by_uuid_whatever_number_cuda_gives_it(monkeypatch):
    from lit_dist.callbacks.circuit_breaker import nvml_index

    class Node:  # NVML's view: all four GPUs of the node, in PCI order
        uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]

        class NVMLError(Exception):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            if uuid not in self.uuids:
                raise self.NVMLError("Not Found")  # what NVML says for a GPU it doesn't know
            return self.uuids.index(uuid)

        def nvmlDeviceGetIndex(self, handle):
            return handle

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvml_index(Node(), 0, uuid="d") == 3, "CUDA's device 0 may be NVML's 3 (fastest-first order)"
    assert nvml_index(Node(), 1, uuid="GPU-c") == 2
    assert nvml_index(Node(), 1, uuid="e") == 3, "no such UUID: CUDA_VISIBLE_DEVICES maps it"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-c")
    assert nvml_index(Node(), 0, uuid="e") == 0, "UUIDs in CUDA_VISIBLE_DEVICES can't be mapped by number"



# -- NVML missing or misnamed ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "message"), [
    ("pynvmll", r"GPUCircuitBreaker.nvml_module = 'pynvmll': no module named 'pynvmll'; use 'pynvml'"),
    ("tests.helpers.fake_nvmll", r"nvml_module = 'tests.helpers.fake_nvmll': no module named 'tests.helpers.fake_nvmll'"),
    ("nvidia.nvml", r"nvml_module = 'nvidia.nvml': no module named 'nvidia(.nvml)?'; use 'pynvml' \(from nvidia-ml-py"),
    ("json", r"nvml_module = 'json': not an NVML module \(it has no nvmlInit, NVMLError, nvmlDeviceGetHandleByIndex\)"),
    ("", r"nvml_module = '': not a module name"),
])
def test_an_nvml_module_that_is_not_there_is_a_config_error_when_the_breaker_is_built(name, message):
    from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker

    with pytest.raises(ConfigError, match=message) as raised:
        GPUCircuitBreaker(nvml_module=name)
    assert raised.value.exit_code == 2
    GPUCircuitBreaker(nvml_module="tests.helpers.fake_nvml")  # the double has pynvml's API


@pytest.mark.process
def test_a_misspelt_nvml_module_stops_lit_dist_fit_with_exit_2_before_training(tmp_path, demo_data):
    from tests.conftest import lit_dist, quickstart_args

    out = lit_dist("fit", *quickstart_args(tmp_path, demo_data, trainer__max_epochs=1),
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.nvml_module", "pynvm")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "lit-dist: error: GPUCircuitBreaker.nvml_module = 'pynvm': no module named 'pynvm'; use 'pynvml'" \
        in out.stderr, out.stderr[-3000:]
    assert "Epoch 0" not in out.stdout + out.stderr


def _breaker_setup(monkeypatch, tmp_path, device: str, rank: int = 0, **kwargs):
    """``setup`` of a breaker in a run on ``device`` (a CUDA device as CPU-only torch sees one: available)."""
    from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker

    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"0": {"fail_init": True}}))
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    monkeypatch.setenv("LOCAL_RANK", "0")
    if device.startswith("cuda"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    breaker = GPUCircuitBreaker(**kwargs)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)), global_rank=rank)
    breaker.setup(trainer, None, "fit")
    return breaker


def test_on_a_cuda_device_without_nvml_every_rank_warns_that_its_gpu_is_not_watched(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    breaker = _breaker_setup(monkeypatch, tmp_path, "cuda:0", rank=3, nvml_module="tests.helpers.fake_nvml")
    assert not breaker.enabled and breaker._thread is None, "training goes on, unwatched"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.records
    assert warnings[0].startswith("lit-dist: rank 3 (") and "GPUCircuitBreaker disabled: NVML unavailable " \
        "(NVML Shared Library Not Found); this rank's GPU is not watched" in warnings[0], warnings


def test_on_a_cuda_device_an_nvml_module_that_cannot_be_imported_is_a_warning_not_a_config_error(
        monkeypatch, tmp_path, caplog):
    # The module is there (not a typo) but a library it needs is not: NVML cannot be loaded on this node.
    (tmp_path / "broken_nvml.py").write_text("import libnvidia_ml_binding_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    breaker = _breaker_setup(monkeypatch, tmp_path, "cuda:0", rank=1, nvml_module="broken_nvml")
    assert not breaker.enabled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("lit-dist: rank 1 (")
    assert "GPUCircuitBreaker disabled: broken_nvml cannot be imported (No module named " \
        "'libnvidia_ml_binding_not_installed')" in warnings[0], warnings


def test_on_a_cpu_run_the_breaker_stays_off_without_a_warning(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    breaker = _breaker_setup(monkeypatch, tmp_path, "cpu", nvml_module="tests.helpers.fake_nvml")
    assert not breaker.enabled and breaker._thread is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_failing_nvml_query_while_watching_is_a_fault_and_a_bug_is_not(monkeypatch, tmp_path):
    import threading

    from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker
    from tests.helpers import fake_nvml

    breaker = GPUCircuitBreaker(nvml_module="tests.helpers.fake_nvml", poll_interval_s=0.01)
    breaker.nvml, breaker.index = fake_nvml, 0

    def lost(index):
        breaker._stop.set()  # one poll
        raise fake_nvml.NVMLError("GPU is lost")

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetHandleByIndex", lost)
    breaker._poll()
    assert breaker.fault == "NVML query failed: GPU is lost"

    # A bug in reading (not NVML's error) is not reported as a GPU fault (exit 10 drains a healthy node): the
    # thread ends with the error, which threading's excepthook prints.
    breaker = GPUCircuitBreaker(nvml_module="tests.helpers.fake_nvml", poll_interval_s=0.01)
    breaker.nvml, breaker.index = fake_nvml, 0
    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetHandleByIndex", lambda index: breaker._stop.set() or {}["handle"])
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))
    thread = threading.Thread(target=breaker._poll)
    thread.start()
    thread.join(5)
    assert seen == [KeyError] and breaker.fault is None
