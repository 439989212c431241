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
from collections.abc import Sequence
from pathlib import Path

from lit_dist.model.adapters import Adapter, adapter_layers, base_fingerprint, base_names, scaled
from lit_dist.model.kohya import check_kohya, kohya_file, kohya_metadata, kohya_names

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
    ``kohya`` "kohya" (a LoRA on SD 1.5, SDXL or Flux only: a ConfigError for anything else)."""
    from safetensors.torch import save_file

    from lit_dist.errors import DataError
    from lit_dist.model.nets.pipeline import whole_folder

    if kohya:
        check_kohya(folder.family.name, adapter)

    layers = {k: v.contiguous() for k, v in adapter_state(model, state).items()}
    if not layers:
        raise DataError(f"the checkpoint holds no weights of its run's adapter ({adapter.describe()} on "
                        f"{folder.path}): was it written by another run?")
    renamed = kohya_names(layers, adapter, folder.family.name, model) if kohya else None
    pipeline = folder.pipeline_class()
    with whole_folder(output, replace) as partial:
        if kohya:  # one file, named as the folder is, as kohya's scripts write it and UIs list it
            save_file(renamed, str(partial / kohya_file(output)),
                      metadata=kohya_metadata(folder.family.name, folder.path, adapter))
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


def empty_adapted_denoiser(folder, adapter: Adapter):
    """The denoiser of ``folder`` with no weights (meta tensors) and ``adapter`` in it: the names an export needs,
    without loading the base."""
    from lit_dist.model.nets.pipeline import empty_denoiser

    model = empty_denoiser(folder)
    adapter.attach(model, folder.family.name)
    return model


def adapter_card(adapter: Adapter, folder, output: str, kind: str, init_weights: str | None = None) -> tuple[str, list[str]]:
    """For the model card of the adapter folder ``output`` of ``kind`` (write_adapter's) on the pipeline folder
    ``folder`` (its denoiser's weights from ``init_weights`` where the run started from a file): what the adapter is,
    and the lines of Python that load it onto its base."""
    name, base, denoiser = Path(output).expanduser().absolute().name, folder.path, folder.family.denoiser
    started = ([f"# the adapter was trained on this pipeline with its {denoiser}'s weights from {init_weights} "
                f"(model.init_weights): load them into pipeline.{denoiser} first"] if init_weights else [])
    if kind in ("diffusers", "kohya"):
        weight = f', weight_name="{kohya_file(output)}"' if kind == "kohya" else ""
        lines = ["from diffusers import DiffusionPipeline", f'pipeline = DiffusionPipeline.from_pretrained("{base}")',
                 *started, f'pipeline.load_lora_weights("{name}"{weight})']
    else:
        lines = ["from diffusers import DiffusionPipeline",
                 "from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict",
                 "from safetensors.torch import load_file",
                 f'pipeline = DiffusionPipeline.from_pretrained("{base}")', *started,
                 f'config = PeftConfig.from_pretrained("{name}")',
                 f"inject_adapter_in_model(config, pipeline.{denoiser})",
                 f'set_peft_model_state_dict(pipeline.{denoiser}, load_file("{name}/{PEFT_FILES[1]}"))']
    return adapter.describe() + (f", on a {denoiser} started from {init_weights}" if init_weights else ""), lines


def merged_weights(folder, adapter: Adapter, state: dict, fingerprint=None, scale: float = 1.0,
                   init_weights: str | None = None, init_weights_skip: Sequence[str] = ()) -> dict:
    """The denoiser of ``folder`` (a ``PipelineFolder``; its weights from ``init_weights`` where the run started from
    a file) with the adapter of ``state`` (a ``PipelineDenoiser``'s state dict) merged into its weights at ``scale``:
    a ``PipelineDenoiser``'s state dict without the adapter, as ``write_pipeline`` writes it. ``fingerprint``: the
    base's the checkpoint holds (a ConfigError if the folder's denoiser is another one)."""
    import torch

    from lit_dist.ckpt.init_weights import start_from
    from lit_dist.errors import ConfigError, DataError
    from lit_dist.model.nets.pipeline import PipelineDenoiser

    net = PipelineDenoiser(str(folder.path))  # the base's weights: a merge needs them
    if init_weights is not None:
        start_from(net, init_weights, init_weights_skip)
    adapter.attach(net)
    names = base_names(net)
    if fingerprint is not None and not torch.equal(base_fingerprint(net, names), fingerprint):
        raise ConfigError(f"--merge: the denoiser of {folder.path} is not the base the adapter was trained on (the "
                          "checkpoint holds that base's fingerprint): give the run's own pipeline with --pipeline, "
                          "and keep the file its model.init_weights names where it was")
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
