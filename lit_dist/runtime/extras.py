"""The optional extras of lit-dist (``pip install 'lit-dist[latent]'``, pyproject.toml) and the check, made when a run
is built, that what its config names has its extra installed: one line and exit 2 before any step, instead of a
``ModuleNotFoundError`` at the first validation.

    require("diffusers", "samples (the sampler of model.objective FlowMatching)")
"""

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from contextlib import contextmanager

from lit_dist.errors import ConfigError

# package -> the extra of pyproject.toml that installs it
EXTRAS = {"diffusers": "latent", "transformers": "text", "deepspeed": "deepspeed", "peft": "adapters"}
# Packages that import bitsandbytes where it is installed, for the quantized bases lit-dist does not load: diffusers
# (its model base, through its quantizers, and its hooks import peft) and peft. With it, the imports a pipeline run
# makes took 1.7 s of CPU in each of its processes, 0.8 without, and on a machine without bitsandbytes' CPU kernels
# every run printed a line about them. A run whose optimizer is bitsandbytes' has imported it (its config names it)
# and is left as it is.
_BITSANDBYTES_IMPORTERS = ("diffusers", "peft")


def require(package: str, what: str) -> None:
    """Import ``package`` (it is about to be used: the import is not wasted) or raise a ConfigError naming ``what``
    needs it and the extra that installs it."""
    try:
        if package in _BITSANDBYTES_IMPORTERS and package not in sys.modules and "bitsandbytes" not in sys.modules:
            _import_without_bitsandbytes(package)
        else:
            importlib.import_module(package)
    except ImportError as exc:
        extra = EXTRAS.get(package)
        how = f"pip install 'lit-dist[{extra}]'" if extra else f"pip install {package}"
        raise ConfigError(f"{what} needs {package}, which is not installed here ({exc}): {how}") from exc


def _import_without_bitsandbytes(package: str) -> None:
    """``package`` and the other importers of bitsandbytes that are installed, imported while ``import bitsandbytes``
    raises ImportError and ``find_spec`` finds nothing: each takes it as not installed, for good."""
    sys.modules["bitsandbytes"] = None
    try:
        importlib.import_module(package)
        for other in _BITSANDBYTES_IMPORTERS:
            if other not in sys.modules and importlib.util.find_spec(other) is not None:
                importlib.import_module(other)
        if "peft" in sys.modules:  # peft looks again when it makes an adapter's layers: its answer is cached now
            from peft import import_utils

            for check in ("is_bnb_available", "is_bnb_4bit_available"):
                getattr(import_utils, check, lambda: None)()
    finally:
        del sys.modules["bitsandbytes"]


def bitsandbytes_without_hub_kernels() -> None:
    """Make this process's first ``import bitsandbytes`` (a run whose optimizer is its AdamW8bit) run with the
    ``kernels`` package hidden. On a CPU with AVX-512 BF16 (the hosts of many GPU nodes) bitsandbytes' import asks the
    Hugging Face Hub, through ``kernels``, for a 4-bit matmul kernel lit-dist never uses: without the Hub's answer
    every process printed a line about it, and behind a network that accepts and never answers, the import (the
    reading of the run's config) waited for minutes, with no line at all. Without ``kernels`` bitsandbytes keeps its
    own kernels, and its one line about it is left out."""
    if "bitsandbytes" not in sys.modules and not any(isinstance(f, _BitsandbytesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _BitsandbytesFinder())


class _BitsandbytesFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: at the first ``import bitsandbytes`` it leaves ``sys.meta_path`` and hands the real
    finders' spec on, its loader wrapped by ``_WithoutKernels``."""

    def find_spec(self, name, path=None, target=None):
        if name != "bitsandbytes":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutKernels(spec.loader)
        return spec


class _WithoutKernels(importlib.abc.Loader):
    """The real loader's, but its ``exec_module`` runs with ``kernels`` hidden; the module keeps the real loader."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # what the package's own code may ask its loader
        hidden, log = sys.modules.get("kernels"), logging.getLogger("bitsandbytes.backends.cpu.ops")
        notice = _HubKernelNotice()
        sys.modules["kernels"] = None  # `from kernels import get_kernel` raises ImportError, which bitsandbytes takes
        log.addFilter(notice)
        try:
            self.loader.exec_module(module)
        finally:
            log.removeFilter(notice)
            if hidden is None:
                del sys.modules["kernels"]
            else:
                sys.modules["kernels"] = hidden


class _HubKernelNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "from kernels-community" not in record.getMessage()


class _TorchvisionNotice(logging.Filter):
    """transformers' notice, once per process, that an image processor falls back to its PIL version without
    torchvision: diffusers' SDXL and Flux pipeline modules import CLIPImageProcessor and SiglipImageProcessor (for the
    safety checker and image prompts lit-dist does not use), and lit-dist installs no torchvision (no CPU build)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in record.getMessage()


@contextmanager
def quiet_loading():
    """Around lit-dist's loads of a pretrained folder's components (``require`` the library first): transformers'
    and diffusers' progress bars off, which every rank drew and a log file keeps as one line per redraw, and the
    torchvision notice left out. Their warnings stay: a weight that a folder lacks is one of them."""
    libraries = [importlib.import_module(f"{name}.utils.logging") for name in ("transformers", "diffusers")
                 if name in sys.modules]
    shown = [library.is_progress_bar_enabled() for library in libraries]
    notices = logging.getLogger("transformers.utils.import_utils")
    notice = _TorchvisionNotice()
    for library in libraries:
        library.disable_progress_bar()
    notices.addFilter(notice)
    try:
        yield
    finally:
        notices.removeFilter(notice)
        for library, on in zip(libraries, shown, strict=True):
            if on:
                library.enable_progress_bar()
