"""The optional extras of lit-dist (``pip install 'lit-dist[latent]'``, pyproject.toml) and the check, made when a run
is built, that what its config names has its extra installed: one line and exit 2 before any step, instead of a
``ModuleNotFoundError`` at the first validation.

    require("diffusers", "samples (the sampler of model.objective FlowMatching)")
"""

import importlib

from lit_dist.errors import ConfigError

# package -> the extra of pyproject.toml that installs it
EXTRAS = {"diffusers": "latent", "transformers": "text", "deepspeed": "deepspeed", "peft": "adapters"}


def require(package: str, what: str) -> None:
    """Import ``package`` (it is about to be used: the import is not wasted) or raise a ConfigError naming ``what``
    needs it and the extra that installs it."""
    try:
        importlib.import_module(package)
    except ImportError as exc:
        extra = EXTRAS.get(package)
        how = f"pip install 'lit-dist[{extra}]'" if extra else f"pip install {package}"
        raise ConfigError(f"{what} needs {package}, which is not installed here ({exc}): {how}") from exc
