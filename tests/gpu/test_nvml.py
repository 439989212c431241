"""The circuit breaker reads a real GPU through NVML."""

import pynvml

from lit_dist.callbacks.circuit_breaker import Judge, read


def test_a_real_gpu_reads_and_is_healthy():
    pynvml.nvmlInit()
    reading = read(pynvml, 0)
    assert reading.uuid.startswith("GPU-") and reading.name and reading.pci
    assert reading.temperature_c is not None and 0 < reading.temperature_c < 110
    assert reading.memory_used_gb is not None and reading.power_w is not None
    assert Judge(0, 5, 3)(reading)[0] is None
