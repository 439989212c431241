"""An adapter run's weights out: the adapter alone, in the format its users load.

- A LoRA (or DoRA) on a family whose diffusers pipeline loads LoRAs (SD 1.5, SDXL, SD3, Flux):
  ``pytorch_lora_weights.safetensors`` with diffusers' key names, written by the pipeline class's own
  ``save_lora_weights``, as diffusers' LoRA training scripts write it: ``pipeline.load_lora_weights(folder)``.
- LoHa and LoKr (which diffusers' ``load_lora_weights`` does not take), and any adapter on PixArt (whose pipeline
  has no LoRA loader): peft's format, ``adapter_config.json`` and ``adapter_model.safetensors``, which peft puts into
  the pipeline's denoiser (``inject_adapter_in_model`` and ``set_peft_model_state_dict``; the model card shows how).

Either way the folder is written beside its place and renamed into it, with a model card naming the base.
``merged_weights`` gives the other way out: the base with the adapter merged into its weights, for a whole pipeline
folder (``lit-dist export --merge true``).
"""

import copy
from pathlib import Path

from lit_dist.model.adapters import Adapter, adapter_layers, base_fingerprint, base_names, scaled

LORA_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights and load_lora_weights name it
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_state(model, state: dict) -> dict:
    """The adapter's entries of ``state`` (a ``PipelineDenoiser``'s state dict: ``model.`` + the diffusers model's
    names) in peft's names, without the adapter's name (``...to_q.lora_A.weight``)."""
    from lit_dist.model.adapters import import_peft

    get_peft_model_state_dict = import_peft().get_peft_model_state_dict
    inner = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return get_peft_model_state_dict(model, state_dict=inner)


def write_adapter(folder, model, adapter: Adapter, state: dict, output: str, replace: bool = False,
                  kohya: bool = False) -> str:
    """The adapter in ``model`` (the denoiser of the pipeline folder ``folder``, a ``PipelineFolder``, which holds
    it) with the weights of ``state`` as a folder at ``output``; returns its format: "diffusers", "peft", or with
    ``kohya`` "kohya" (a LoRA on SD 1.5 or SDXL only: a ConfigError for anything else)."""
    import diffusers
    from safetensors.torch import save_file

    from lit_dist.errors import DataError
    from lit_dist.model.nets.pipeline import whole_folder

    if kohya:
        _check_kohya(folder, adapter)

    layers = {k: v.contiguous() for k, v in adapter_state(model, state).items()}
    if not layers:
        raise DataError(f"the checkpoint holds no weights of its run's adapter ({adapter.describe()} on "
                        f"{folder.path}): was it written by another run?")
    pipeline = getattr(diffusers, folder.index["_class_name"], None)
    with whole_folder(output, replace) as partial:
        if kohya:  # one file, named as the folder is, as kohya's scripts write it and UIs list it
            save_file(kohya_names(layers, adapter), str(partial / kohya_file(output)),
                      metadata=_kohya_metadata(folder, adapter))
            kind = "kohya"
        elif adapter.kind == "lora" and hasattr(pipeline, "save_lora_weights"):  # what load_lora_weights reads
            # peft's names, as diffusers' LoRA scripts for SD3 and Flux save them (its older names, which the SDXL
            # script converts to, are not read back by SD3's loader); every family's loader reads these.
            pipeline.save_lora_weights(str(partial), **{f"{folder.family.denoiser}_lora_layers": layers},
                                       safe_serialization=True)
            kind = "diffusers"
        else:
            config = copy.deepcopy(model.peft_config["default"])
            config.base_model_name_or_path = str(folder.path / folder.family.denoiser)
            config.save_pretrained(str(partial))  # adapter_config.json
            save_file(layers, str(partial / PEFT_FILES[1]))
            kind = "peft"
    return kind


# kohya's sd-scripts name a U-Net LoRA's layers by their module path (dots to underscores) under lora_unet_, with
# lora_down (peft's lora_A), lora_up (lora_B) and a scalar alpha each; ComfyUI and A1111 read these names for SD 1.5
# and SDXL, and so does diffusers' load_lora_weights. (Flux's and SD3's kohya names are those of their original
# checkpoints, fused projections included: their diffusers-format files are what ComfyUI reads for them.)
KOHYA_FAMILIES = ("sd15", "sdxl")
_KOHYA_PARTS = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}


def kohya_file(output: str) -> str:
    """The file name of a kohya-format adapter written to the folder ``output``: the folder's name."""
    return f"{Path(output).expanduser().absolute().name}.safetensors"


def _check_kohya(folder, adapter: Adapter) -> None:
    from lit_dist.errors import ConfigError

    if folder.family.name not in KOHYA_FAMILIES:
        raise ConfigError(f"--format kohya: kohya's names are written for SD 1.5 and SDXL LoRAs, and this run's "
                          f"pipeline is {folder.family.name}: write diffusers' format (--format diffusers), which "
                          "diffusers and ComfyUI load")
    if adapter.kind != "lora" or adapter.use_dora:
        raise ConfigError(f"--format kohya: written for a LoRA, and this run trained a {adapter.describe()}: write "
                          "it in diffusers' or peft's format (--format diffusers)")


def kohya_names(layers: dict, adapter: Adapter) -> dict:
    """A LoRA's ``layers`` (peft's names: ``down_blocks.1...to_q.lora_A.weight``) under kohya's names, with an
    ``alpha`` per layer."""
    import torch

    out = {}
    for key, value in layers.items():
        module, part = next((key[: -len(p) - 1], p) for p in _KOHYA_PARTS if key.endswith("." + p))
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.{_KOHYA_PARTS[part]}"] = value
        out[f"{name}.alpha"] = torch.tensor(adapter.alpha)
    return out


def _kohya_metadata(folder, adapter: Adapter) -> dict:
    """The header fields kohya's scripts write that UIs show: the network, its rank and alpha, the base."""
    return {"ss_network_module": "networks.lora", "ss_network_dim": str(adapter.rank),
            "ss_network_alpha": f"{adapter.alpha:g}", "ss_base_model_version": {"sd15": "sd_v1", "sdxl": "sdxl_base_v1-0"}
            [folder.family.name], "ss_sd_model_name": folder.path.name, "written_by": "lit-dist"}


def empty_adapted_denoiser(folder, adapter: Adapter):
    """The denoiser of ``folder`` with no weights (meta tensors) and ``adapter`` in it: the names an export needs,
    without loading the base."""
    from lit_dist.model.nets.pipeline import empty_denoiser

    model = empty_denoiser(folder)
    adapter.attach(model, folder.family.name)
    return model


def adapter_card(adapter: Adapter, folder, output: str, kind: str) -> tuple[str, list[str]]:
    """For the model card of the adapter folder ``output`` of ``kind`` (write_adapter's) on the pipeline folder
    ``folder``: what the adapter is, and the lines of Python that load it onto its base."""
    name, base, denoiser = Path(output).expanduser().absolute().name, folder.path, folder.family.denoiser
    if kind in ("diffusers", "kohya"):
        weight = f', weight_name="{kohya_file(output)}"' if kind == "kohya" else ""
        lines = ["from diffusers import DiffusionPipeline", f'pipeline = DiffusionPipeline.from_pretrained("{base}")',
                 f'pipeline.load_lora_weights("{name}"{weight})']
    else:
        lines = ["from diffusers import DiffusionPipeline",
                 "from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict",
                 "from safetensors.torch import load_file",
                 f'pipeline = DiffusionPipeline.from_pretrained("{base}")',
                 f'config = PeftConfig.from_pretrained("{name}")',
                 f"inject_adapter_in_model(config, pipeline.{denoiser})",
                 f'set_peft_model_state_dict(pipeline.{denoiser}, load_file("{name}/{PEFT_FILES[1]}"))']
    return adapter.describe(), lines


def merged_weights(folder, adapter: Adapter, state: dict, fingerprint=None, scale: float = 1.0) -> dict:
    """The denoiser of ``folder`` (a ``PipelineFolder``) with the adapter of ``state`` (a ``PipelineDenoiser``'s
    state dict) merged into its weights at ``scale``: a ``PipelineDenoiser``'s state dict without the adapter, as
    ``write_pipeline`` writes it. ``fingerprint``: the base's the checkpoint holds (a ConfigError if the folder's
    denoiser is another one)."""
    import torch

    from lit_dist.errors import ConfigError, DataError
    from lit_dist.model.nets.pipeline import PipelineDenoiser

    net = PipelineDenoiser(str(folder.path))  # the base's weights: a merge needs them
    adapter.attach(net)
    names = base_names(net)
    if fingerprint is not None and not torch.equal(base_fingerprint(net, names), fingerprint):
        raise ConfigError(f"--merge: the denoiser of {folder.path} is not the base the adapter was trained on (the "
                          "checkpoint holds that base's fingerprint): give the run's own pipeline with --pipeline")
    missing, unexpected = net.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in names]
    if missing or unexpected:
        raise DataError(f"the checkpoint's adapter does not fit {adapter.describe()} on {folder.path}: "
                        f"{len(missing)} weights missing ({', '.join(missing[:3])}), {len(unexpected)} unexpected "
                        f"({', '.join(unexpected[:3])}): was it written by another run?")
    with torch.no_grad(), scaled(net, scale):
        for layer in adapter_layers(net):
            layer.merge()
    whole = net.state_dict()
    return {name.replace(".base_layer.", "."): whole[name] for name in names}
