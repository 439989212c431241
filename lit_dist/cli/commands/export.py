"""``lit-dist export CKPT --output PATH``: any checkpoint's network, in the format its users load.

    lit-dist export runs/my-run/slurm-123/checkpoints/step-000004000 --output model.pt
    lit-dist export runs/my-run/slurm-123/checkpoints --output model.safetensors    # the newest usable one
    lit-dist export runs/sdxl/slurm-123/checkpoints --output sdxl-shapes            # a pipeline run: a diffusers folder
    lit-dist export downloaded.ckpt --output model.pt --trust_pickle       # a file you trust that holds other types
    lit-dist export runs/my-run/slurm-123/checkpoints --ema true --output model-ema.pt   # the weight average

    net.load_state_dict(torch.load("model.pt", weights_only=True))             # --format state_dict
    net.load_state_dict(safetensors.torch.load_file("model.safetensors"))      # --format safetensors
    DiffusionPipeline.from_pretrained("sdxl-shapes")                           # --format diffusers

An adapter run's (model.adapter) checkpoint leaves as the adapter alone (a LoRA as diffusers'
pytorch_lora_weights.safetensors; ``pipeline.load_lora_weights(folder)``), or with ``--merge true`` as the whole
pipeline with the adapter merged into its denoiser's weights.
"""

import os
from typing import Literal

import torch

from lit_dist.ckpt.export import load_checkpoint_state, network_state, save_atomically, to_full_precision
from lit_dist.ckpt.init_weights import init_weights_of
from lit_dist.errors import ConfigError, DataError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str, output: str = "model.pt", ema: bool = False, trust_pickle: bool = False,
           format: Literal["auto", "diffusers", "kohya", "safetensors", "state_dict"] = "auto",
           pipeline: str | None = None,
           dtype: Literal["fp32", "bf16", "fp16"] = "fp32", merge: bool = False, adapter_scale: float = 1.0) -> None:
    """Write the wrapped network of a checkpoint for use outside lit-dist.

    Args:
        checkpoint: A checkpoint file (.ckpt) or folder (FSDP sharded, DeepSpeed ZeRO) written by lit-dist or Lightning.
        output: Where to write: a file (state_dict, safetensors) or a new folder (diffusers).
        ema: Write the network with its weight average (model.ema) in place of the trained weights.
        trust_pickle: Unpickle whatever types the checkpoint names (unpickling can run any code): only for a file
            you trust. Without it, a checkpoint holding a type beyond lit-dist's own is refused (exit code 3).
        format: diffusers (a pipeline folder DiffusionPipeline.from_pretrained loads, with a model card; an adapter
            run's adapter alone, as diffusers or peft load it), kohya (an SD 1.5, SDXL or Flux LoRA under the
            names kohya's scripts and ComfyUI read, one file in a folder), safetensors (one file), state_dict
            (torch.save); auto: diffusers for a run of pipeline.path, else safetensors for an output ending in
            .safetensors, else state_dict.
        pipeline: The pipeline folder the run fine-tuned; default: pipeline.path of the run's config.yaml.
        dtype: Floating-point type of the weights written: fp32, or bf16/fp16 for half the size.
        merge: An adapter run's: write the whole pipeline with the adapter merged into the denoiser's weights
            (loaded from --pipeline), instead of the adapter alone.
        adapter_scale: With merge, the strength of the adapter merged in: its update times this.
    """
    from lit_dist.ckpt.model_card import run_config, run_dir_of

    if not os.path.exists(checkpoint):
        raise DataError(f"checkpoint {checkpoint!r} does not exist")
    config = run_config(run_dir_of(checkpoint))
    base = pipeline or (config.get("pipeline") or {}).get("path")
    if format == "auto":
        format = "diffusers" if base else "safetensors" if output.endswith(".safetensors") else "state_dict"
    if format in ("diffusers", "kohya") and not base:
        raise ConfigError(f"--format {format} writes a pipeline fine-tuned from a pipeline folder, and {checkpoint} "
                          "has no run config.yaml naming one (pipeline.path): give it with --pipeline FOLDER")
    spec = ((config.get("model") or {}).get("init_args") or {}).get("adapter")
    if format == "kohya" and not spec:
        raise ConfigError(f"--format kohya writes an adapter run's LoRA, and {checkpoint}'s run has no model.adapter "
                          "in its config.yaml")
    if (merge or adapter_scale != 1.0) and not spec:
        raise ConfigError(f"--merge and --adapter_scale are for an adapter run (model.adapter), and {checkpoint}'s "
                          "run has none in its config.yaml")
    if merge and format != "diffusers":
        raise ConfigError(f"--merge writes a diffusers pipeline folder, and --format is {format}: leave --format "
                          "at auto")
    if adapter_scale != 1.0 and not merge:
        raise ConfigError(f"--adapter_scale {adapter_scale:g} without --merge true: the adapter alone is written as "
                          "trained; diffusers sets its strength at load (pipeline.set_adapters(..., "
                          "adapter_weights=...)), or merge it at that scale with --merge true")
    whole = load_checkpoint_state(checkpoint, trust_pickle)
    state = to_full_precision(network_state(whole, ema))
    folder = adapter = None
    if format in ("diffusers", "kohya"):
        from lit_dist.cache.pipelines import read_folder
        from lit_dist.model.adapters import Adapter

        folder = read_folder(base, "--pipeline")
        adapter = Adapter(**(spec.get("init_args") or {})) if spec else None
    if merge:  # the adapter into the base's float32 weights, then the dtype asked for
        from lit_dist.model.adapter_export import merged_weights

        state = merged_weights(folder, adapter, state, whole.get("adapter_base"), adapter_scale, *init_weights_of(config))
    state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    count = sum(v.numel() for v in state.values())
    if folder is not None:
        _diffusers(checkpoint, folder, state, output, config, ema, adapter if not merge else None,
                   f" with its adapter merged in at scale {adapter_scale:g}" if merge else "", kohya=format == "kohya")
    elif format == "safetensors":
        _safetensors(state, output)
    else:
        save_atomically(state, output)
    print(f"lit-dist export: {len(state)} tensors ({count:,} values, {dtype}) from {checkpoint} -> {output} ({format})")


def _diffusers(checkpoint: str, folder, state: dict, output: str, config: dict, ema: bool, adapter, merged: str,
               kohya: bool = False) -> None:
    """A folder with its model card: the pipeline ``folder`` fine-tuned, or ``adapter`` (the run's) alone, under
    kohya's names with ``kohya``."""
    from pathlib import Path

    from lit_dist.ckpt.model_card import checkpoint_facts, run_dir_of, write_card
    from lit_dist.model.nets.pipeline import write_pipeline

    card = None
    if adapter is not None:  # an adapter run: the adapter alone (lit_dist/model/adapter_export.py)
        from lit_dist.model.adapter_export import adapter_card, empty_adapted_denoiser, write_adapter

        kind = write_adapter(folder, empty_adapted_denoiser(folder, adapter), adapter, state, output, kohya=kohya)
        target = Path(output).expanduser().absolute()
        card = adapter_card(adapter, folder, output, kind, init_weights_of(config)[0])
    else:
        target = write_pipeline(str(folder.path), state, output)
    write_card(target, folder.path, folder.family.name, folder.index["_class_name"],
               f"checkpoint `{checkpoint}`{merged}", config, ema, checkpoint_facts(checkpoint), run_dir_of(checkpoint),
               adapter=card)


def _safetensors(state: dict, output: str) -> None:
    from lit_dist.ckpt.files import filesystem, write_atomically
    from lit_dist.runtime.extras import require

    require("safetensors", "--format safetensors")
    from safetensors.torch import save

    data = save({k: v.contiguous() for k, v in state.items()}, metadata={"format": "pt", "written_by": "lit-dist"})
    fs, path = filesystem(os.path.abspath(output))
    write_atomically(fs, path, lambda f: f.write(data))
