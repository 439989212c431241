"""The circuit breaker against a real GPU: NVML readings, the breaker's thread in a run, real CUDA errors."""

import subprocess
import sys

import pynvml
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker, Judge, nvml_index, read
from tests.conftest import CONFIGS, REPO, lit_dist


def test_a_real_gpu_is_found_by_uuid_reads_and_is_healthy():
    pynvml.nvmlInit()
    index = nvml_index(pynvml, 0)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    reading = read(pynvml, index)
    assert reading.uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"), "NVML's GPU is CUDA's device 0"
    assert reading.name and reading.pci
    assert reading.temperature_c is not None and 0 < reading.temperature_c < 110
    assert reading.memory_used_gb is not None and reading.power_w is not None
    assert Judge(0, 5, 3)(reading)[0] is None


def test_gpu_health_reaches_tensorboard_from_the_breaker_thread(tmp_path, demo_data):
    out = lit_dist("fit", "--config", str(CONFIGS / "quickstart.yaml"), "--data.metadata", str(demo_data),
                   "--data.batch_size_per_device", "8", "--trainer.devices", "1", "--trainer.max_epochs", "1",
                   "--trainer.log_every_n_steps", "5", "--run.root_dir", str(tmp_path), "--run.run_id", "nvml",
                   "--trainer.enable_progress_bar", "false",
                   "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
                   "--trainer.callbacks.poll_interval_s", "0.2", timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "GPUCircuitBreaker disabled" not in out.stdout + out.stderr
    events = EventAccumulator(str(tmp_path / "quickstart" / "nvml"))
    events.Reload()
    temperatures = [e.value for e in events.Scalars("gpu/temperature_c")]
    assert temperatures and all(0 < t < 110 for t in temperatures)
    assert all(e.value > 0 for e in events.Scalars("gpu/memory_used_gb"))
    assert [e.value for e in events.Scalars("gpu/ecc_uncorrectable")][-1] == 0


def test_a_real_out_of_memory_is_not_a_gpu_fault():
    breaker = GPUCircuitBreaker()
    trainer = type("T", (), {"callbacks": []})()
    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
    assert breaker.on_exception(trainer, None, caught.value) is None


ILLEGAL_ACCESS = """
import cupy, torch
from lit_dist.callbacks.circuit_breaker import GPUCircuitBreaker, GPUFault
torch.zeros(1, device="cuda")  # torch's context first: cupy shares it
write = cupy.RawKernel('extern "C" __global__ void write(int *p) { *p = 1; }', "write")
write((1,), (1,), (cupy.uint64(8),))  # a store to address 8: an illegal address on the device
try:
    torch.cuda.synchronize()
except RuntimeError as exc:
    try:
        GPUCircuitBreaker().on_exception(type("T", (), {"callbacks": []})(), None, exc)
    except GPUFault as fault:
        print("GPU FAULT:", fault)
"""


def test_a_real_illegal_address_is_a_gpu_fault():
    pytest.importorskip("cupy")
    # In a child process: the error poisons its CUDA context for good.
    out = subprocess.run([sys.executable, "-c", ILLEGAL_ACCESS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "GPU FAULT:" in out.stdout and "illegal memory access" in out.stdout, out.stdout + out.stderr[-3000:]
