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

    from tests.conftest import CONFIGS, lit_dist

    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"0": {"fail_init": True}}))
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
                   "--data.batch_size_per_device", "8", "--trainer.max_epochs", "1", "--run.root_dir", str(tmp_path),
                   "--trainer.enable_progress_bar", "false",
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0",
                   env={"FAKE_NVML_STATE": str(state)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (out.stdout + out.stderr).count("GPUCircuitBreaker disabled: NVML unavailable") == 1
