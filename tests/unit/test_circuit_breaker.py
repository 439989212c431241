from lit_dist.callbacks.circuit_breaker import HW_SLOWDOWN, POWER_BRAKE, THERMAL_SLOWDOWN, Judge, Reading


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

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return self.uuids.index(uuid)  # ValueError for a GPU it doesn't know

        def nvmlDeviceGetIndex(self, handle):
            return handle

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvml_index(Node(), 0, uuid="d") == 3, "CUDA's device 0 may be NVML's 3 (fastest-first order)"
    assert nvml_index(Node(), 1, uuid="GPU-c") == 2
    assert nvml_index(Node(), 1, uuid="e") == 3, "no such UUID: CUDA_VISIBLE_DEVICES maps it"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-c")
    assert nvml_index(Node(), 0, uuid="e") == 0, "UUIDs in CUDA_VISIBLE_DEVICES can't be mapped by number"
