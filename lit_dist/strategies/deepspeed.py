"""``DeepSpeedStrategy``: Lightning's, able to run on CPU processes too (``configs/deepspeed_*.yaml``), and whether
DeepSpeed is installed."""

import glob
import importlib.util
import os
import re
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

from lit_dist.ckpt.store import STATE
from lit_dist.errors import ConfigError


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's DeepSpeed strategy, which also runs on CPU processes (for tests and small runs).

    On GPUs it is Lightning's, unchanged. With ``trainer.accelerator: cpu`` it skips two of Lightning's checks,
    both about CUDA devices, not about DeepSpeed: the guard that refuses any accelerator but CUDA (added in 2022,
    when DeepSpeed itself could not run on CPU; DeepSpeed now has a CPU accelerator, gloo when oneCCL is absent)
    and the check of CUDA device indices; and it gives DeepSpeed the local rank as its device rank, where
    Lightning gives the CPU device's index (None). ZeRO 1-3 and CPU offload then train, save and resume on CPU.
    """

    def __init__(self, logging_batch_size_per_gpu: int | str = "auto", **kwargs):
        """Lightning's DeepSpeedStrategy arguments (``config``: a DeepSpeed JSON file or dict, and the rest).

        Args:
            logging_batch_size_per_gpu: DeepSpeed's micro batch when its JSON leaves it out; lit-dist sets it to data.batch_size_per_device.
        """
        super().__init__(logging_batch_size_per_gpu=logging_batch_size_per_gpu, **kwargs)
        self._micro_batch = logging_batch_size_per_gpu
        # ZeRO otherwise stops any optimizer but its own list (torch's Adam, AdamW, ...) with an assertion, Prodigy and
        # bitsandbytes' 8-bit AdamW among them; Lightning's default config allows them too. A JSON that sets it wins.
        if isinstance(self.config, dict):
            self.config.setdefault("zero_allow_untested_optimizer", True)

    def _auto_select_batch_size(self) -> int:
        # Lightning reads the loader's batch_size, which lit-dist's loaders leave unset (the dataset returns whole
        # batches); Lightning applies logging_batch_size_per_gpu only where no JSON is given.
        return self._micro_batch if isinstance(self._micro_batch, int) else super()._auto_select_batch_size()

    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self._on_cpu():
            super().setup_environment()
            return
        # Read by DeepSpeed when it is first imported (by setup_distributed, next): its CPU accelerator.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        DDPStrategy.setup_environment(self)  # what Lightning's does after its CUDA-only guard

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        _unlink_shm_buffer(self.global_rank)

    @contextmanager
    def _device_rank(self):
        """Within: the CPU devices carry the ranks' indices, which Lightning hands DeepSpeed as ``device_rank``."""
        if not self._on_cpu():
            yield
            return
        devices = self.parallel_devices
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(devices))]
        try:
            yield
        finally:
            self.parallel_devices = devices

    def _setup_model_and_optimizer(self, *args, **kwargs):
        with self._device_rank():
            return super()._setup_model_and_optimizer(*args, **kwargs)

    def _initialize_deepspeed_inference(self, *args, **kwargs):
        with self._device_rank():
            return super()._initialize_deepspeed_inference(*args, **kwargs)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        # An adapter run's checkpoint holds the adapter, not its frozen base (lit_dist.model.adapters): else ZeRO-2
        # and 3 write every frozen parameter's partition beside the module's state.
        self.exclude_frozen_parameters = getattr(self.lightning_module, "adapter", None) is not None
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Lightning's, after one check: a resume of training on as many processes as saved the checkpoint. DeepSpeed
        partitions the optimizer state (and under ZeRO-3 the weights and their average) by process and cannot
        repartition it: elsewhere it ends in its own exception's traceback. The keys the module may lack or hold
        beyond its own (its ``optional_state``: the weight average, which model.ema turns on or off at a resume) are
        left out of DeepSpeed's strict load; those it lacked are started by ``start_unsaved`` once the whole
        checkpoint is loaded (under ZeRO-3 the weights' partitions come with the optimizer state)."""
        saved = _deepspeed_world_size(checkpoint_path)
        if saved not in (None, self.world_size) and self.lightning_module.trainer.state.fn == "fit":
            path = Path(checkpoint_path)
            path = path.parent if path.name == STATE else path  # the checkpoint's folder, as lit-dist names it
            raise ConfigError(f"the checkpoint {path} was saved by DeepSpeed on {saved} processes and this "
                              f"run has {self.world_size}: DeepSpeed resumes only on as many as saved it. Run on {saved} "
                              "processes (trainer.devices x trainer.num_nodes), or start a new run (run.run_id); "
                              f"`lit-dist export {path}` writes its weights")
        module = self.lightning_module
        optional = getattr(module, "optional_state", lambda key: False)
        unsaved: list[str] = []

        def tolerate(_, incompatible) -> None:  # the module's load_state_dict post-hook: strict about the rest
            for keys, lacked in ((incompatible.missing_keys, True), (incompatible.unexpected_keys, False)):
                for key in [k for k in keys if optional(k)]:
                    keys.remove(key)
                    if lacked:
                        unsaved.append(key)

        handle = module.register_load_state_dict_post_hook(tolerate)
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            handle.remove()
        if unsaved and hasattr(module, "start_unsaved"):
            module.start_unsaved(unsaved)
        return checkpoint


def _unlink_shm_buffer(rank: int) -> None:
    """Remove the name of this rank's shared-memory buffer of DeepSpeed's CPU all-reduce, once every rank has
    mapped every other's (DeepSpeed's ``shm_initialize`` returns only then; the barrier waits for all of them).
    DeepSpeed never removes it: each CPU run left 69 MB per rank in /dev/shm for good. The mappings stay valid;
    the memory goes with the last process that maps it, a killed one included."""
    import torch.distributed as dist

    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{rank}"  # deepspeed/ops/csrc/cpu/comm/shm.cpp
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    with suppress(FileNotFoundError):  # DeepSpeed without its shm all-reduce (ranks on several nodes, older builds)
        os.unlink(name)


def _deepspeed_world_size(path) -> int | None:
    """How many processes saved the DeepSpeed checkpoint at ``path`` (one optimizer-state file each); None if it
    holds none."""
    from lit_dist.ckpt.deepspeed_files import rank_files

    return len(rank_files(path, "optim_states")) or None


INSTALL_DEEPSPEED = "Install it with `pip install --no-build-isolation deepspeed` (bash .ci/setup does)."


def deepspeed_installed() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):  # ValueError: blocked as None in sys.modules
        return False


def missing_deepspeed(parse_error: str) -> str | None:
    """The message for a config that names a DeepSpeed class (the offload presets' optimizer) where DeepSpeed
    is not installed, instead of the type error the parser gives; None for any other parse error."""
    from lit_dist.errors import explain_parse_error

    named = re.search(r"class_path='(deepspeed\.[\w.]+)'", parse_error)
    if named is None or deepspeed_installed():
        return None
    field = explain_parse_error(parse_error).split(": ", 1)[0]
    return f"{field} = {named.group(1)!r} but DeepSpeed is not installed. {INSTALL_DEEPSPEED}"


# DeepSpeed's operators that a run on CPU processes uses, by the name torch builds them under: the shared-memory
# collectives of its CPU accelerator (every DeepSpeed run on CPU) and the CPU Adam of the offload presets. DeepSpeed
# compiles one on its first load (torch's cpp_extension, into TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by
# default) and loads it from there afterwards.
CPU_OPS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}


def build_cpu_ops(names: list[str], say: bool = True) -> list[str]:
    """Make sure DeepSpeed's CPU operators ``names`` (keys of ``CPU_OPS``) are built: those not built yet are
    compiled now, once, with a line saying so and how long it took (``say``: this process speaks for the machine);
    a compile that fails is one ConfigError with the compiler's last error. Returns the names compiled here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed is first imported
    from deepspeed.ops.op_builder import cpu as builders

    missing = [name for name in names if not _built(name)]
    if missing and say:
        print(f"lit-dist: building DeepSpeed's CPU operators {', '.join(missing)} for this machine, once (about a "
              f"minute each on 2 cores); later runs load them from {_build_root()}", flush=True)
    began = time.monotonic()
    for name in names:
        _wait_for_another_build(name, say)
        try:
            getattr(builders, CPU_OPS[name])().load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - whatever the build raises, one line with the compiler's own words
            raise ConfigError(f"building DeepSpeed's CPU operator {name} failed: {_last_error(exc)}. DeepSpeed's "
                              "CPU runs need a C++ compiler and ninja (Debian: apt-get install g++ ninja-build; pip "
                              "install ninja); or run on GPUs, or with another strategy") from exc
    if missing and say:
        print(f"lit-dist: built {', '.join(missing)} in {time.monotonic() - began:.0f} s", flush=True)
    return missing


def _build_root() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


# A build takes about a minute on 2 cores, a few on a loaded machine: a lock older than this is a killed build's.
STALE_LOCK_S = 900.0


def _wait_for_another_build(name: str, say: bool, every_s: float = 30.0) -> None:
    """Wait while another process builds operator ``name``: torch's ``lock`` file in its build folder, which torch
    itself waits on forever. A line every ``every_s`` seconds (``say``); a lock older than ``STALE_LOCK_S`` was left
    by a build that was killed (Ctrl-C, a job's time limit): a ConfigError naming the file to delete."""
    said = time.monotonic()
    while locks := [lock for lock in (os.path.join(folder, "lock") for folder in _build_folders(name))
                    if os.path.exists(lock)]:
        try:
            age = time.time() - os.path.getmtime(locks[0])
        except FileNotFoundError:  # the build ended just now
            continue
        if age > STALE_LOCK_S:
            raise ConfigError(f"DeepSpeed's CPU operator {name} has been locked for {age / 60:.0f} minutes by "
                              f"{locks[0]}, which a build leaves when it is killed: if no run is building it now (on "
                              "any machine that shares that folder), delete that file and run again")
        if say and time.monotonic() - said >= every_s:
            print(f"lit-dist: waiting for another process to build DeepSpeed's CPU operator {name} ({locks[0]}, "
                  f"{age:.0f} s)", flush=True)
            said = time.monotonic()
        time.sleep(0.5)


def _built(name: str) -> bool:
    """Whether torch's JIT build folder holds operator ``name``, compiled (a build left half done does not count)."""
    return any(glob.glob(os.path.join(folder, f"{name}*.so")) for folder in _build_folders(name))


def _build_folders(name: str) -> list[str]:
    """torch's build folder of operator ``name``: ``$TORCH_EXTENSIONS_DIR/{name}`` where that is set, else
    ``~/.cache/torch_extensions/py311_cpu/{name}`` (a folder per Python and accelerator build)."""
    root = _build_root()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return [os.path.join(root, name)]
    return glob.glob(os.path.join(root, "*", name))


def _last_error(exc: BaseException) -> str:
    """The compiler's last error line in a failed build's message (torch puts the build's output there), else the
    message's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith("ninja: build stopped")]
    return (errors or lines or [type(exc).__name__])[-1]
