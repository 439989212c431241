"""``GPUCircuitBreaker``: every rank watches its own GPU through NVML and the whole run stops on a fault.

    trainer:
      callbacks:
        - class_path: lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker
          init_args: {poll_interval_s: 5, margin_c: 5}

A background thread polls this rank's device every ``poll_interval_s`` (no NVML call
on the training thread) and trips on: a new volatile uncorrectable ECC error beyond
``ecc_threshold``, pending retired pages or a failed row remap, a temperature within
``margin_c`` of the GPU's shutdown threshold, or hardware-slowdown / power-brake
throttling that persists for ``throttle_polls`` polls. Thermal slowdown alone is a
``gpu.warning``. When it trips, the rank that saw it publishes ``gpu.fault`` (with the GPU's
index, UUID, name, PCI id and readings) to the webhooks and the console; the fault is a fact
shared with the run control (``lit_dist.runtime.control``), so at most ``control.sync_every_n_steps`` + 1
steps later all ranks stop together at the same step and exit with code 10 (docs/exit-codes.md)
so Slurm or Kubernetes can drain the node. In a Slurm job (``exclude_node``, on by default
there) rank 0 first requeues the job with the faulty GPU's node added to the job's excluded nodes,
so that it starts again on healthy nodes and resumes from its last checkpoint.

It logs (from the thread's last reading, on logging steps):

===========================  ==================================================
``gpu/temperature_c``        GPU temperature
``gpu/power_w``              board power draw
``gpu/memory_used_gb``       device memory in use (all processes)
``gpu/utilization``          percent of time a kernel ran
``gpu/ecc_uncorrectable``    volatile uncorrectable ECC errors since start
===========================  ==================================================

Without a CUDA device (a CPU run) it logs one info line on rank 0 and does nothing. On a CUDA device
(or with ``device_index`` set) a rank whose NVML cannot be loaded (no driver library, no permission)
logs a warning naming itself and trains on unwatched: the run goes on, but the protection asked for
is visibly missing there. An ``nvml_module`` that names no module, or a module without the pynvml
API, is a configuration error (exit 2) when the breaker is built, on any machine.
"""

import importlib
import logging
import os
import socket
import threading
from dataclasses import asdict, dataclass, field

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_dist.errors import ConfigError, ExitCode, LitDistError
from lit_dist.runtime.control import Agreed, Event, RunControl, Stop
from lit_dist.runtime.slurm import check_exclusion, excluding

log = logging.getLogger(__name__)

HW_SLOWDOWN, THERMAL_SLOWDOWN, POWER_BRAKE = 0x8, 0x40, 0x80
# Messages of CUDA errors that mean the hardware or driver is at fault (not the program).
HARDWARE_ERRORS = ("illegal memory access", "an illegal instruction", "uncorrectable ecc", "ecc error",
                   "unspecified launch failure", "launch failure", "xid", "gpu has fallen off the bus",
                   "hardware stack error")
NOT_HARDWARE = {"out of memory": "lower data.batch_size_per_device, enable activation checkpointing or shard the model",
                "nccl": "a rank stopped answering or the network failed; check the other ranks' logs and NCCL_DEBUG=INFO",
                "timed out": "a collective timed out: a rank is stuck or dead; check the other ranks' logs"}


class GPUFault(LitDistError):
    """A rank's GPU is faulty; every rank stops with the GPU-fault exit code."""

    exit_code = ExitCode.GPU_FAULT


@dataclass
class Reading:
    """One poll of one GPU; None where the GPU does not support a query."""

    index: int
    uuid: str = ""
    name: str = ""
    pci: str = ""
    temperature_c: float | None = None
    shutdown_c: float | None = None
    power_w: float | None = None
    memory_used_gb: float | None = None
    utilization: float | None = None
    ecc_uncorrectable: int | None = None
    retired_pending: bool | None = None
    remap_failed: bool | None = None
    throttle: int = 0
    extra: dict = field(default_factory=dict)


def read(nvml, index: int) -> Reading:
    """Query NVML for device ``index``."""
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    r = Reading(index=index)

    def get(fn, *args):
        try:
            return fn(handle, *args)
        except nvml.NVMLError:
            return None

    r.uuid = _text(get(nvml.nvmlDeviceGetUUID))
    r.name = _text(get(nvml.nvmlDeviceGetName))
    pci = get(nvml.nvmlDeviceGetPciInfo)
    r.pci = _text(getattr(pci, "busId", "")) if pci is not None else ""
    r.temperature_c = get(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    r.shutdown_c = get(nvml.nvmlDeviceGetTemperatureThreshold, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
    power = get(nvml.nvmlDeviceGetPowerUsage)
    r.power_w = power / 1000 if power is not None else None
    memory = get(nvml.nvmlDeviceGetMemoryInfo)
    r.memory_used_gb = memory.used / 1e9 if memory is not None else None
    utilization = get(nvml.nvmlDeviceGetUtilizationRates)
    r.utilization = utilization.gpu if utilization is not None else None
    r.ecc_uncorrectable = get(nvml.nvmlDeviceGetTotalEccErrors, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
    pending = get(nvml.nvmlDeviceGetRetiredPagesPendingStatus)
    r.retired_pending = bool(pending) if pending is not None else None
    remap = get(nvml.nvmlDeviceGetRemappedRows)  # (corrected, uncorrected, pending, failure)
    r.remap_failed = bool(remap[3]) if remap is not None else None
    r.throttle = get(nvml.nvmlDeviceGetCurrentClocksThrottleReasons) or 0
    return r


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


class Judge:
    """Turns successive readings of one GPU into faults and warnings (pure logic, no NVML)."""

    def __init__(self, ecc_threshold: int, margin_c: float, throttle_polls: int):
        self.ecc_threshold = ecc_threshold
        self.margin_c = margin_c
        self.throttle_polls = throttle_polls
        self.ecc_baseline: int | None = None
        self.throttled_polls = 0

    def __call__(self, r: Reading) -> tuple[str | None, str | None]:
        """(fault reason, warning reason) for a reading."""
        if r.ecc_uncorrectable is not None:
            if self.ecc_baseline is None:
                self.ecc_baseline = r.ecc_uncorrectable
            new = r.ecc_uncorrectable - self.ecc_baseline
            if new > self.ecc_threshold:
                return f"{new} new volatile uncorrectable ECC errors", None
        if r.retired_pending:
            return "retired pages pending (a reset is needed)", None
        if r.remap_failed:
            return "row remapping failed", None
        if r.temperature_c is not None and r.shutdown_c and r.temperature_c >= r.shutdown_c - self.margin_c:
            return f"temperature {r.temperature_c} C within {self.margin_c} C of shutdown ({r.shutdown_c} C)", None
        if r.throttle & (HW_SLOWDOWN | POWER_BRAKE):
            self.throttled_polls += 1
            if self.throttled_polls >= self.throttle_polls:
                kind = "hardware slowdown" if r.throttle & HW_SLOWDOWN else "power-brake slowdown"
                return f"{kind} for {self.throttled_polls} consecutive polls", None
        else:
            self.throttled_polls = 0
        if r.throttle & THERMAL_SLOWDOWN:
            return None, "thermal slowdown"
        return None, None


class GPUCircuitBreaker(Callback):
    """Stops every rank together when any rank's GPU turns faulty; see the module docstring."""

    def __init__(
        self,
        poll_interval_s: float = 5.0,
        ecc_threshold: int = 0,
        margin_c: float = 5.0,
        throttle_polls: int = 3,
        save_checkpoint: bool = False,
        nvml_module: str = "pynvml",
        device_index: int | None = None,
        exclude_node: bool | None = None,
    ):
        """Configure the breaker.

        Args:
            poll_interval_s: Seconds between NVML polls of this rank's GPU (on a background thread).
            ecc_threshold: New volatile uncorrectable ECC errors tolerated before tripping (0: none).
            margin_c: Trip when the temperature is within this many degrees C of the GPU's shutdown threshold.
            throttle_polls: Polls in a row of hardware-slowdown or power-brake throttling before tripping.
            save_checkpoint: Save a checkpoint before stopping (off by default: the hardware is suspect).
            nvml_module: Module providing the pynvml API (a test double can stand in).
            device_index: NVML index of the GPU to watch; default: this rank's CUDA device.
            exclude_node: Requeue the Slurm job without the faulty GPU's node (added to its excluded nodes); default: in a Slurm job.
        """
        check_exclusion("GPUCircuitBreaker.exclude_node", exclude_node)
        try:
            load_nvml(nvml_module)  # a misspelt name is a config error on every machine, not only on a GPU
        except ImportError:
            pass  # the module is there but cannot be imported here: setup warns where a GPU needs it
        self.poll_interval_s = poll_interval_s
        self.judge = Judge(ecc_threshold, margin_c, throttle_polls)
        self.save_checkpoint = save_checkpoint
        self.nvml_module = nvml_module
        self.device_index = device_index
        self.exclude_node = exclude_node
        self.requeued: str | None = None  # what rank 0's requeue did, for the error message
        self.enabled = False
        self.index: int | None = None
        self.last: Reading | None = None
        self.fault: str | None = None
        self._warned: set[str] = set()
        self._reported = False
        self._control: RunControl | None = None
        self._stopping = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- setup ------------------------------------------------------------------------------

    def connect(self, control: RunControl) -> None:
        self._control = control
        control.share("gpu.fault", "max", lambda: 1.0 if self.fault else 0.0)
        control.on_agreed(self._decide)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._control is None:
            raise ConfigError("GPUCircuitBreaker needs lit_dist.runtime.control.RunControl among the trainer's callbacks "
                              "(lit-dist fit adds it; add RunControl() when building a Trainer yourself)")

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self._thread is not None:
            return
        device = trainer.strategy.root_device
        if self.device_index is None and (device.type != "cuda" or not torch.cuda.is_available()):
            rank_zero_info("lit-dist: GPUCircuitBreaker disabled: no CUDA device")
            return
        try:
            self.nvml = load_nvml(self.nvml_module)
        except ImportError as exc:  # found, but it (or a library it imports) cannot be loaded on this node
            self._unwatched(trainer, f"{self.nvml_module} cannot be imported ({exc})")
            return
        try:
            self.nvml.nvmlInit()
            self.index = self.device_index if self.device_index is not None else nvml_index(self.nvml, device.index)
            self.last = read(self.nvml, self.index)
        except self.nvml.NVMLError as exc:  # no driver library, no permission, a GPU NVML cannot see
            self._unwatched(trainer, f"NVML unavailable ({exc})")
            return
        self.enabled = True
        self._thread = threading.Thread(target=self._poll, name="lit-dist-gpu-breaker", daemon=True)
        self._thread.start()

    def _unwatched(self, trainer, reason: str) -> None:
        """This rank's GPU cannot be watched: a warning from every rank it happens on, and the run goes on."""
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        log.warning("lit-dist: rank %d (%s): GPUCircuitBreaker disabled: %s; this rank's GPU is not watched. "
                    "Install the NVIDIA driver's NVML (libnvidia-ml.so.1) on this node, or remove the breaker "
                    "from trainer.callbacks", trainer.global_rank, host, reason)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                reading = read(self.nvml, self.index)
            except self.nvml.NVMLError as exc:  # NVML itself failing (GPU lost, driver gone) is a symptom too
                self.fault = self.fault or f"NVML query failed: {exc}"
                continue
            self.last = reading
            fault, warning = self.judge(reading)
            if fault and not self.fault:
                self.fault = fault
            if warning and warning not in self._warned:
                self._warned.add(warning)
                self._webhook("gpu.warning", "warning", f"GPU {self.index} {warning}", warning)

    # -- every step boundary --------------------------------------------------------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._report_fault()
        if self.last is not None and trainer.global_step % trainer.log_every_n_steps == 0 and trainer.is_global_zero:
            values = {"gpu/temperature_c": self.last.temperature_c, "gpu/power_w": self.last.power_w,
                      "gpu/memory_used_gb": self.last.memory_used_gb, "gpu/utilization": self.last.utilization,
                      "gpu/ecc_uncorrectable": self.last.ecc_uncorrectable}
            values = {name: float(value) for name, value in values.items() if value is not None}
            # Straight to the loggers: pl_module.log would copy each float to the GPU, a host-device sync each.
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)

    def _report_fault(self) -> None:
        """The rank that saw the fault publishes it, once, before the run stops."""
        if self.fault and not self._reported:
            self._reported = True
            self._webhook("gpu.fault", "critical", f"GPU {self.index} fault", self.fault)

    def _decide(self, trainer, agreed: Agreed) -> None:
        """Every rank, at the same step: some rank's GPU is faulty, so the run stops (saving first if asked)."""
        self._report_fault()
        if not agreed["gpu.fault"] or self._stopping:
            return
        self._stopping = True
        where = f"this rank's GPU {self.index}: {self.fault}" if self.fault else "another rank's GPU"
        faulty = [rank for rank, value in enumerate(agreed.per_rank("gpu.fault")) if value]
        nodes = sorted({self._control.where(rank)["node"] for rank in faulty} - {None})
        step = trainer.global_step

        def announce(trainer, saved) -> None:
            if trainer.is_global_zero and nodes and excluding(self.exclude_node):
                from lit_dist.runtime.slurm import requeue

                self.requeued = requeue(exclude=nodes)
                log.warning("lit-dist: GPU fault on %s: %s", ", ".join(nodes), self.requeued)

        def error(saved) -> GPUFault:
            if self.requeued:
                then = f"; {self.requeued}"
            elif nodes and excluding(self.exclude_node):
                then = f"; rank 0 requeues the job without node {', '.join(nodes)}"
            else:
                then = ". Drain the node and requeue elsewhere."
            return GPUFault(f"GPU fault on {where} (node {', '.join(nodes) or '?'}); all ranks stopped at step "
                            f"{step}{then}")

        self._control.request_stop(Stop(error, save="gpu-fault" if self.save_checkpoint else None, announce=announce))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        text = str(exception).lower()
        if isinstance(exception, GPUFault) or not isinstance(exception, RuntimeError):
            return
        for needle, hint in NOT_HARDWARE.items():
            if needle in text:
                log.error("lit-dist: not a GPU fault (%s): %s", needle, hint)
                return
        if any(needle in text for needle in HARDWARE_ERRORS):
            self.fault = f"CUDA error: {str(exception)[:300]}"
            self._webhook("gpu.fault", "critical", f"GPU {self.index} fault", self.fault)
            if self._control is not None:
                self._control.flush()
            raise GPUFault(f"GPU fault: {self.fault}") from exception

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop.set()

    # -- events ---------------------------------------------------------------------------

    def _webhook(self, type_: str, severity: str, title: str, reason: str) -> None:
        data = {"reason": reason, "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname()}
        if self.last is not None:
            data.update({k: v for k, v in asdict(self.last).items() if v is not None and k != "extra"})
        event = Event(type_, severity, title, f"{title}: {reason}", data)
        if self._control is not None:
            self._control.publish(event)  # the console logs it too
        else:
            log.warning("lit-dist: %s: %s", title, reason)


def load_nvml(name: str):
    """The module ``name`` (``nvml_module``): a ConfigError if there is no such module or it lacks pynvml's API.

    ImportError from a module that exists but cannot be imported here passes through: that is NVML being
    unavailable on this node, not a mistake in the config.
    """
    fix = ("use 'pynvml' (from nvidia-ml-py, installed with lit-dist) or the import path of a module with the "
           "pynvml API, e.g. tests.helpers.fake_nvml")
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise  # the module is there; something it imports is not
        raise ConfigError(f"GPUCircuitBreaker.nvml_module = {name!r}: no module named {exc.name!r}; {fix}") from exc
    except (ValueError, TypeError) as exc:  # an empty or a relative name
        raise ConfigError(f"GPUCircuitBreaker.nvml_module = {name!r}: not a module name ({exc}); {fix}") from exc
    missing = [attr for attr in ("nvmlInit", "NVMLError", "nvmlDeviceGetHandleByIndex") if not hasattr(module, attr)]
    if missing:
        raise ConfigError(f"GPUCircuitBreaker.nvml_module = {name!r}: not an NVML module (it has no "
                          f"{', '.join(missing)}); {fix}")
    return module


def nvml_index(nvml, cuda_index: int, uuid: str | None = None) -> int:
    """NVML's number for this process's CUDA device ``cuda_index``.

    The two numberings differ: NVML counts every GPU of the node in PCI order, CUDA only the
    visible ones (CUDA_VISIBLE_DEVICES from Slurm or a container), fastest first unless
    CUDA_DEVICE_ORDER=PCI_BUS_ID. The UUID is the same in both, so that decides; the
    CUDA_VISIBLE_DEVICES list is the fallback where the UUID can't be had.
    """
    try:
        uuid = uuid or str(torch.cuda.get_device_properties(cuda_index).uuid)
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        return int(nvml.nvmlDeviceGetIndex(handle))
    except (nvml.NVMLError, RuntimeError, AssertionError) as exc:  # NVML: no such UUID; torch: no such device
        log.info("lit-dist: GPU %d not found by UUID through NVML (%s); using CUDA_VISIBLE_DEVICES", cuda_index, exc)
    entries = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if entries and all(v.isdigit() for v in entries) and cuda_index < len(entries):
        return int(entries[cuda_index])
    return cuda_index
