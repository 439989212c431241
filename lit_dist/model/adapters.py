"""Adapters on a frozen denoiser: LoRA (and DoRA), and LyCORIS's LoHa and LoKr, through peft.

``model.adapter`` puts an adapter into ``model.net`` when the model is built, before any strategy wraps or shards
it: the base's parameters are frozen (``requires_grad`` off), the adapter's are the only trainable ones, so only
they reach the optimizer and the weight average (``model.ema``). On a pipeline's denoiser
(lit_dist.model.nets.pipeline.PipelineDenoiser) it goes into the diffusers model itself, as diffusers' own LoRA
scripts do (``add_adapter``), so that its weights keep the names diffusers reads back.

    model:
      adapter:
        kind: lora            # lora, loha or lokr
        rank: 16
        alpha: 16
        # target_modules: [to_q, to_k, to_v, to_out.0]   # default: the family's (TARGETS)

LoCon, LyCORIS's LoRA on convolutions too, is ``kind: lora`` with the convolutions' names in ``target_modules``
(peft's LoRA takes ``Conv2d``).

A checkpoint of an adapter run holds the adapter, not the base (``base_names``): the base comes from where the
model gets it at every start (the pipeline folder), and the checkpoint holds its fingerprint (``base_fingerprint``)
so that a resume on another base is refused rather than trained on.
"""

import hashlib
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.runtime.extras import require


def import_peft():
    """peft, imported as ``require`` imports it: without bitsandbytes (lit_dist/runtime/extras.py)."""
    require("peft", "model.adapter")
    import peft

    return peft

# The layers each family's adapter goes into unless target_modules says: the attention projections diffusers' own
# LoRA scripts train (train_dreambooth_lora_sdxl.py; for SD3 and Flux their joint attention's context projections
# and feed-forwards too, as train_dreambooth_lora_sd3.py and _flux.py do).
_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
_JOINT = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
          "attn.add_v_proj", "attn.to_add_out")
TARGETS = {
    "sd15": _ATTENTION,
    "sdxl": _ATTENTION,
    "pixart": _ATTENTION,
    "sd3": _JOINT,
    "flux": _JOINT + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
}
KINDS = ("lora", "loha", "lokr")
# Layer names of the text encoders (CLIP's and T5's), which kohya's and diffusers' scripts adapt with
# --train_text_encoder: named in target_modules, they get the reason they are not found in the denoiser.
_TEXT_ENCODER_LAYERS = {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "q", "k", "v", "o", "wi", "wo",
                        "wi_0", "wi_1"}


class Adapter:
    """An adapter for ``model.adapter``: its kind and size; ``attach`` puts it into a network."""

    def __init__(self, kind: Literal["lora", "loha", "lokr"] = "lora", rank: int = 16, alpha: float | None = None,
                 dropout: float = 0.0, target_modules: list[str] | None = None, use_dora: bool = False,
                 init: Literal["default", "gaussian", "pissa", "olora"] = "default", decompose_factor: int = -1,
                 decompose_both: bool = False):
        """Describe the adapter.

        Args:
            kind: lora (low-rank update; with use_dora, DoRA), loha (Hadamard product of two low-rank updates) or
                lokr (Kronecker product), the last two LyCORIS's.
            rank: The rank of the low-rank factors (LoRA's r; LoHa's and LoKr's dim).
            alpha: Scale of the update, as alpha / rank; default: rank (a scale of 1).
            dropout: Dropout on the adapter's path (LoRA's input; LoHa's and LoKr's rank dimensions).
            target_modules: Names (or name suffixes) of the layers to adapt; default: the pipeline family's
                attention projections (lit_dist.model.adapters.TARGETS), or every Linear of another network.
            use_dora: Decompose each update into magnitude and direction (DoRA; lora only).
            init: How LoRA's factors start (default: the update starts at zero, the base's outputs unchanged).
            decompose_factor: LoKr's factor of a layer's dimensions into its Kronecker blocks; -1: as square as
                the dimensions allow.
            decompose_both: LoKr: decompose both Kronecker factors into low-rank ones (fewer parameters).
        """
        problems = []
        if kind not in KINDS:
            problems.append(f"model.adapter.kind = {kind!r}: must be one of {', '.join(KINDS)}")
        if rank < 1:
            problems.append(f"model.adapter.rank = {rank}: must be at least 1")
        if alpha is not None and alpha <= 0:
            problems.append(f"model.adapter.alpha = {alpha}: must be positive (or null: the rank)")
        if not 0 <= dropout < 1:
            problems.append(f"model.adapter.dropout = {dropout}: must be in [0, 1)")
        if use_dora and kind != "lora":
            problems.append(f"model.adapter.use_dora is LoRA's; kind is {kind!r}: set kind: lora or use_dora: false")
        if init != "default" and kind != "lora":
            problems.append(f"model.adapter.init = {init!r} is LoRA's; kind is {kind!r}: leave it default")
        if target_modules is not None and not target_modules:
            problems.append("model.adapter.target_modules is empty: name the layers to adapt, or null for the default")
        ConfigError.collect(problems)
        self.kind, self.rank, self.dropout = kind, rank, dropout
        self.alpha = float(alpha) if alpha is not None else float(rank)
        self.target_modules = list(target_modules) if target_modules is not None else None
        self.use_dora, self.init = use_dora, init
        self.decompose_factor, self.decompose_both = decompose_factor, decompose_both

    def config(self, targets: list[str]):
        """The peft config of this adapter on the layers ``targets``."""
        require("peft", "model.adapter")
        peft = import_peft()

        if self.kind == "lora":
            init = True if self.init == "default" else self.init
            return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                   target_modules=targets, use_dora=self.use_dora, init_lora_weights=init)
        common = {"r": self.rank, "alpha": self.alpha, "rank_dropout": self.dropout, "target_modules": targets}
        if self.kind == "loha":
            return peft.LoHaConfig(**common)
        return peft.LoKrConfig(**common, decompose_factor=self.decompose_factor, decompose_both=self.decompose_both)

    def attach(self, net: nn.Module, family: str | None = None) -> nn.Module:
        """Put this adapter into ``net`` (in place), which freezes the rest of it; returns the module that holds the
        adapter: a pipeline denoiser's diffusers model, or ``net`` (the denoiser of the pipeline ``family``, if
        given)."""
        from lit_dist.model.nets.pipeline import PipelineDenoiser

        inner = net.model if isinstance(net, PipelineDenoiser) else net
        family = net.family if isinstance(net, PipelineDenoiser) else family
        names = [name for name, _ in inner.named_modules()]
        # The family's preset layers this model has (a small one may lack some).
        preset = [t for t in TARGETS.get(family, ()) if any(_matches(name, t) for name in names)]
        if self.target_modules is not None:
            targets = self.target_modules
        elif family is not None:
            targets = preset or list(TARGETS[family])
        else:
            targets = _linears(inner)
        missing = [t for t in targets if not any(_matches(name, t) for name in names)]
        if missing:
            what = f"the {family} denoiser" if family else type(inner).__name__
            why = ""
            if family and any(t.split(".")[-1] in _TEXT_ENCODER_LAYERS or t.startswith("text_encoder") for t in missing):
                why = (" (adapters go into the denoiser only: its captions come from the cache, encoded once by the "
                       "frozen text encoders)")
            raise ConfigError(f"model.adapter.target_modules: {what} has no layer named {', '.join(missing)}{why}: "
                              f"name layers it has (e.g. {', '.join(preset or _examples(inner))}), or null for the "
                              "default")
        config = self.config(targets)  # peft freezes every parameter of the model but the adapter's
        if hasattr(inner, "add_adapter"):  # a diffusers model: its own entry, which records the adapter as its own
            inner.add_adapter(config)
        else:
            import_peft().inject_adapter_in_model(config, inner)
        return inner

    def describe(self) -> str:
        """The adapter in words, for logs and model cards."""
        extra = " (DoRA)" if self.use_dora else ""
        return f"{self.kind}{extra} rank {self.rank}, alpha {self.alpha:g}"


def base_names(net: nn.Module) -> set[str]:
    """The state-dict names of ``net`` (with its adapter in) that are the base's: every entry but the adapter's
    trainable parameters."""
    trainable = {name for name, p in net.named_parameters() if p.requires_grad}
    return {name for name in net.state_dict() if name not in trainable}


def adapter_layers(net: nn.Module) -> list[nn.Module]:
    """The layers of ``net`` that hold an adapter (peft's tuner layers)."""
    return [m for m in net.modules() if hasattr(m, "set_scale") and hasattr(m, "active_adapters")]


@contextmanager
def scaled(net: nn.Module, scale: float):
    """Within: every adapter layer in ``net`` adds its update times ``scale`` (0: the base alone; 1: as trained),
    as diffusers' ``set_adapters(..., adapter_weights=...)`` does; as trained again after."""
    layers = adapter_layers(net) if scale != 1.0 else []
    for layer in layers:
        for name in layer.active_adapters:
            layer.set_scale(name, scale)
    try:
        yield
    finally:
        for layer in layers:
            for name in layer.active_adapters:
                layer.set_scale(name, 1.0)


FINGERPRINT_VALUES = 64  # values of each base tensor that its fingerprint reads, evenly spaced


def base_fingerprint(net: nn.Module, names: set[str]) -> torch.Tensor:
    """sha256 (32 uint8) of the base entries ``names`` of ``net``'s state dict: each one's name, shape, dtype and
    ``FINGERPRINT_VALUES`` of its values spread over it. Milliseconds on a model of billions of parameters; another
    base (fine-tuned, converted, another model) differs in nearly every value, so the samples see it."""
    sha = hashlib.sha256()
    state = net.state_dict()
    for name in sorted(names):
        tensor = state[name].detach()
        sha.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.reshape(-1)
        if flat.numel() and flat.device.type != "meta":
            at = torch.linspace(0, flat.numel() - 1, min(flat.numel(), FINGERPRINT_VALUES)).long()
            sha.update(flat[at].to("cpu", torch.float64).numpy().tobytes())
    return torch.frombuffer(bytearray(sha.digest()), dtype=torch.uint8)


def _matches(name: str, target: str) -> bool:
    """peft's rule: a target names a module by its full name or a suffix of whole dotted parts."""
    return name == target or name.endswith("." + target)


def _linears(net: nn.Module) -> list[str]:
    """The full names of every Linear layer of ``net``."""
    names = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise ConfigError(f"model.adapter: {type(net).__name__} has no Linear layer to adapt: name its layers in "
                          "model.adapter.target_modules")
    return names


def _examples(net: nn.Module, count: int = 4) -> list[str]:
    """A few layer names of ``net`` a user could target: the last parts of its Linear and Conv2d layers' names."""
    seen: list[str] = []
    for name, module in net.named_modules():
        parts = name.split(".")
        short = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]
        if isinstance(module, nn.Linear | nn.Conv2d) and short not in seen:
            seen.append(short)
    return seen[:count]
