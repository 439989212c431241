"""A pipeline folder's denoiser, called as lit-dist calls every denoiser, computes what the family's own diffusers
pipeline computes around the same weights: each family's glue (SDXL's added conditions, Flux's packed tokens and
guidance, PixArt's learned variance) checked against the pipeline's call of its model."""

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.pipelines import read_folder  # noqa: E402
from lit_dist.errors import ConfigError  # noqa: E402
from lit_dist.model.nets.pipeline import PipelineDenoiser  # noqa: E402
from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402

PROMPT = "a red circle on a white background"
FLUX_GUIDANCE = 3.5


def _pipeline_call(family: str, folder):
    """The family's pipeline run for one step on a 16 x 16 image; returns (the model's call, its output)."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(folder)
    model = pipeline.unet if family in ("sd15", "sdxl") else pipeline.transformer
    seen = {}
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True)
    model.register_forward_hook(lambda m, args, kwargs, out: seen.update(out=out[0]), with_kwargs=True)
    call = {"num_inference_steps": 1, "height": 16, "width": 16, "output_type": "latent",
            "generator": torch.Generator().manual_seed(0), "guidance_scale": 1.0}
    if family in ("sd3", "flux", "pixart"):
        call["max_sequence_length"] = 16
    if family == "flux":
        call["guidance_scale"] = FLUX_GUIDANCE  # Flux.1-dev's guidance is an input of the model, not a second batch
    if family == "pixart":
        call["use_resolution_binning"] = False
    with torch.no_grad():
        pipeline(PROMPT, **call)
    return pipeline, seen


def _as_lit_dist_call(family: str, pipeline, seen):
    """(x_t, timestep on 0 to 1000, condition, the output as x_t's shape) of the pipeline's call of its model."""
    args, kw, out = seen["args"], seen["kwargs"], seen["out"]
    if family in ("sd15", "sdxl"):
        condition = {"hidden": kw["encoder_hidden_states"]}
        if family == "sdxl":
            condition.update(pooled=kw["added_cond_kwargs"]["text_embeds"], time_ids=kw["added_cond_kwargs"]["time_ids"])
        return args[0], args[1].expand(len(args[0])), condition, out
    if family == "sd3":
        return kw["hidden_states"], kw["timestep"], {"hidden": kw["encoder_hidden_states"],
                                                      "pooled": kw["pooled_projections"]}, out
    if family == "flux":
        unpack = type(pipeline)._unpack_latents  # diffusers' own inverse of its packing
        return (unpack(kw["hidden_states"], 16, 16, pipeline.vae_scale_factor), kw["timestep"] * 1000,
                {"hidden": kw["encoder_hidden_states"], "pooled": kw["pooled_projections"]},
                unpack(out, 16, 16, pipeline.vae_scale_factor))
    return args[0], kw["timestep"], {"hidden": kw["encoder_hidden_states"], "mask": kw["encoder_attention_mask"]}, \
        out.chunk(2, dim=1)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_denoiser_computes_what_its_pipeline_computes(family, tmp_path):
    folder = save_pipeline(family, tmp_path / family)
    pipeline, seen = _pipeline_call(family, folder)
    x, timestep, condition, expected = _as_lit_dist_call(family, pipeline, seen)
    net = PipelineDenoiser(str(folder), guidance=FLUX_GUIDANCE).eval()
    assert net.family == family
    with torch.no_grad():
        got = net(x, timestep, condition)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected)
    if family == "sdxl":  # without size conditions: the pipeline's defaults (the image's own size, uncropped)
        with torch.no_grad():
            torch.testing.assert_close(net(x, timestep, {k: v for k, v in condition.items() if k != "time_ids"}),
                                       expected)
    assert [n for n, p in net.named_parameters() if p.requires_grad], "the denoiser is what training updates"


def test_a_condition_without_the_family_s_fields_is_one_line(tmp_path):
    net = PipelineDenoiser(str(save_pipeline("sdxl", tmp_path / "sdxl")))
    with pytest.raises(ConfigError, match="sdxl denoiser takes a condition with hidden, pooled, and got"):
        net(torch.zeros(1, 4, 2, 2), torch.zeros(1), torch.zeros(1, 3, 48))


def test_a_folder_of_an_unknown_family_or_no_pipeline_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder: name a diffusers pipeline folder"):
        read_folder(tmp_path / "missing")
    folder = save_pipeline("sd15", tmp_path / "sd15")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "KandinskyPipeline"}))
    with pytest.raises(ConfigError) as caught:
        read_folder(folder)
    message = str(caught.value)
    assert "holds a KandinskyPipeline (components: " in message and "UNet2DConditionModel" in message
    assert "sdxl (StableDiffusionXLPipeline)" in message and "\n" not in message
    (folder / "model_index.json").write_text(json.dumps(index))
    (folder / "unet" / "config.json").rename(folder / "unet.json")
    read_folder(folder)  # a component's files are the loader's to check; the folder is there
    (folder / "unet").rename(folder / "elsewhere")
    with pytest.raises(ConfigError, match="a StableDiffusionPipeline folder without unet"):
        read_folder(folder)
