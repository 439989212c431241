"""A LoRA under the names kohya's sd-scripts write, which ComfyUI, A1111 and diffusers' ``load_lora_weights`` read.

Each adapted layer is a ``lora_unet_<path>`` with ``lora_down`` (peft's ``lora_A``), ``lora_up`` (``lora_B``) and a
scalar ``alpha`` (the update is ``lora_up @ lora_down * alpha / rank``).

- SD 1.5 and SDXL: the path is the U-Net's module path in diffusers, dots to underscores.
- Flux: the path is the layer's in Black Forest Labs' checkpoint, where a double block's image and text attention
  each have one fused ``qkv`` projection and a single block one ``linear1`` (q, k, v and the MLP's input). Their
  LoRAs in diffusers' model are one per projection, so each fused layer gets them all: ``lora_down`` stacked
  ``[A_q; A_k; A_v]``, ``lora_up`` block-diagonal, rank and alpha times the parts (the same scale), a zero block for a
  part the adapter left out. sd-scripts' own Flux LoRAs split their fused layers the same way, and diffusers'
  converter recognises that layout and splits it back exactly. Every other linear layer of Flux has its BFL name
  too (img_in, time_in_*, final_layer_*, ...).

SD3's kohya names have no reader on this machine to check them against; its LoRAs leave in diffusers' format, which
ComfyUI reads for SD3 and Flux as it is.
"""

from pathlib import Path

from lit_dist.errors import ConfigError
from lit_dist.model.adapters import Adapter

FAMILIES = ("sd15", "sdxl", "flux")
_PARTS = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}
# The header's base model and network module (UIs show them, and filter LoRA lists by the base).
_BASE_VERSION = {"sd15": "sd_v1", "sdxl": "sdxl_base_v1-0", "flux": "flux1"}
_NETWORK = {"flux": "networks.lora_flux"}

# Flux: the layers of a block in diffusers' FluxTransformer2DModel -> their names in BFL's checkpoint.
_FLUX_DOUBLE = {"attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj", "ff.net.0.proj": "img_mlp_0",
                "ff.net.2": "img_mlp_2", "ff_context.net.0.proj": "txt_mlp_0", "ff_context.net.2": "txt_mlp_2",
                "norm1.linear": "img_mod_lin", "norm1_context.linear": "txt_mod_lin"}
_FLUX_DOUBLE_FUSED = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                      "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_FLUX_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_FLUX_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_FLUX_BLOCKS = (("transformer_blocks", "double_blocks", _FLUX_DOUBLE, _FLUX_DOUBLE_FUSED),
                ("single_transformer_blocks", "single_blocks", _FLUX_SINGLE, _FLUX_SINGLE_FUSED))
# The layers outside the blocks. diffusers' reader of kohya's files takes the final layer's factors without their
# alpha, so those two are written with the scale in lora_up and alpha = rank: the same update for every reader.
_FLUX_OUTSIDE = {"x_embedder": "img_in", "context_embedder": "txt_in",
                 "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
                 "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
                 "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
                 "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
                 "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
                 "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer"}
_FLUX_FINAL = {"proj_out": "final_layer_linear", "norm_out.linear": "final_layer_adaLN_modulation_1"}


def kohya_file(output: str) -> str:
    """The file name of a kohya-format adapter written to the folder ``output``: the folder's name."""
    return f"{Path(output).expanduser().absolute().name}.safetensors"


def check_kohya(family: str, adapter: Adapter) -> None:
    """A ConfigError unless kohya's names are written for ``adapter`` on a pipeline of ``family``."""
    if family not in FAMILIES:
        raise ConfigError(f"--format kohya: kohya's names are written for SD 1.5, SDXL and Flux LoRAs, and this run's "
                          f"pipeline is {family}: write diffusers' format (--format diffusers), which diffusers and "
                          "ComfyUI load")
    if adapter.kind != "lora" or adapter.use_dora:
        raise ConfigError(f"--format kohya: written for a LoRA, and this run trained a {adapter.describe()}: write "
                          "it in diffusers' or peft's format (--format diffusers)")


def kohya_names(layers: dict, adapter: Adapter, family: str, model) -> dict:
    """A LoRA's ``layers`` (peft's names: ``down_blocks.1...to_q.lora_A.weight``) under kohya's names for
    ``family``, with an ``alpha`` per layer; ``model``: the denoiser holding the adapter (for the sizes of the parts
    of a fused layer that it left out)."""
    import torch

    factors: dict[str, dict[str, torch.Tensor]] = {}  # a layer's path -> {"lora_A.weight": ..., "lora_B.weight": ...}
    for key, value in layers.items():
        module, part = next((key[: -len(p) - 1], p) for p in _PARTS if key.endswith("." + p))
        factors.setdefault(module, {})[part] = value
    if family != "flux":
        named = {module.replace(".", "_"): (f["lora_A.weight"], f["lora_B.weight"], adapter.alpha)
                 for module, f in factors.items()}
    else:
        named = _flux_layers(factors, model, adapter)
    out = {}
    for name, (down, up, alpha) in named.items():
        out[f"lora_unet_{name}.lora_down.weight"] = down.contiguous()
        out[f"lora_unet_{name}.lora_up.weight"] = up.contiguous()
        out[f"lora_unet_{name}.alpha"] = torch.tensor(float(alpha))
    return out


def _flux_layers(factors: dict, model, adapter: Adapter) -> dict:
    """Flux's adapted layers under BFL's names: {name: (lora_down, lora_up, alpha)}."""
    import torch

    plain, fused = dict(_FLUX_OUTSIDE), {}  # diffusers' path -> BFL's name; BFL's name -> diffusers' paths
    for ours, theirs, layers, groups in _FLUX_BLOCKS:
        for i in sorted({int(m.split(".")[1]) for m in factors if m.startswith(ours + ".")}):
            plain.update({f"{ours}.{i}.{layer}": f"{theirs}_{i}_{name}" for layer, name in layers.items()})
            fused.update({f"{theirs}_{i}_{name}": [f"{ours}.{i}.{m}" for m in members] for name, members in
                          groups.items()})
    named, left = {}, dict(factors)
    for ours, theirs in plain.items():
        if (f := left.pop(ours, None)) is not None:
            named[theirs] = (f["lora_A.weight"], f["lora_B.weight"], adapter.alpha)
    for ours, theirs in _FLUX_FINAL.items():
        if (f := left.pop(ours, None)) is not None:
            up = f["lora_B.weight"] * (adapter.alpha / adapter.rank)
            if ours == "norm_out.linear":  # diffusers' final norm gives (scale, shift), BFL's (shift, scale)
                up = torch.cat(up.chunk(2)[::-1])
            named[theirs] = (f["lora_A.weight"], up, adapter.rank)
    for theirs, paths in fused.items():
        found = [left.pop(p, None) for p in paths]
        if not any(found):
            continue
        rank, dtype = next((f["lora_A.weight"].shape[0], f["lora_A.weight"].dtype) for f in found if f)
        for j, path in enumerate(paths):
            if found[j] is None:  # a part the adapter left out: a zero update in the fused layer
                base = model.get_submodule(path)
                out_features, in_features = getattr(base, "base_layer", base).weight.shape
                found[j] = {"lora_A.weight": torch.zeros(rank, in_features, dtype=dtype),
                            "lora_B.weight": torch.zeros(out_features, rank, dtype=dtype)}
        named[theirs] = (torch.cat([f["lora_A.weight"] for f in found]),
                         torch.block_diag(*(f["lora_B.weight"] for f in found)), adapter.alpha * len(paths))
    if left:
        raise ConfigError(f"--format kohya: Flux's layer {sorted(left)[0]} (of {len(left)} adapted) has no kohya "
                          "name lit-dist writes: write diffusers' format (--format diffusers), which diffusers and "
                          "ComfyUI load")
    return named


def kohya_metadata(family: str, base: Path, adapter: Adapter) -> dict:
    """The header fields kohya's scripts write that UIs show: the network, its rank and alpha, the base."""
    return {"ss_network_module": _NETWORK.get(family, "networks.lora"), "ss_network_dim": str(adapter.rank),
            "ss_network_alpha": f"{adapter.alpha:g}", "ss_base_model_version": _BASE_VERSION[family],
            "ss_sd_model_name": base.name, "written_by": "lit-dist"}
