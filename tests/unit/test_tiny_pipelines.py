"""The pretrained pipelines the fine-tuning tests start from (tests/helpers/pipelines.py) are what a user has on disk:
a folder that diffusers loads by path as its family's own pipeline class, with every component, and that draws an
image from a prompt through its own tokenizers and text encoders."""

import json

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402

PIPELINES = {"sd15": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline",
             "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "pixart": "PixArtSigmaPipeline"}
DENOISERS = {"sd15": "UNet2DConditionModel", "sdxl": "UNet2DConditionModel", "sd3": "SD3Transformer2DModel",
             "flux": "FluxTransformer2DModel", "pixart": "PixArtTransformer2DModel"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_pipeline_folder_loads_by_path_as_its_family_and_draws_a_prompt(family, tmp_path):
    import torch
    from diffusers import DiffusionPipeline

    folder = save_pipeline(family, tmp_path / family)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINES[family]
    denoiser = "unet" if family in ("sd15", "sdxl") else "transformer"
    assert index[denoiser][1] == DENOISERS[family]
    assert (folder / denoiser / "diffusion_pytorch_model.safetensors").is_file()
    assert not [p for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth")], "weights are safetensors"

    pipeline = DiffusionPipeline.from_pretrained(folder)
    assert type(pipeline).__name__ == PIPELINES[family]
    components = {k: v[1] for k, v in index.items() if isinstance(v, list) and v[0] is not None}
    assert {"vae", denoiser, "scheduler"} <= components.keys(), components
    for name, class_name in components.items():
        assert type(getattr(pipeline, name)).__name__ == class_name, name
    call = {"num_inference_steps": 2, "height": 16, "width": 16, "output_type": "np",
            "generator": torch.Generator().manual_seed(0)}
    if family in ("sd3", "flux", "pixart"):
        call["max_sequence_length"] = 16
    if family == "pixart":
        call["use_resolution_binning"] = False  # its bins are for the real sample sizes (1024 px and so on)
    images = [pipeline("a red circle on a white background", **call).images for _ in range(2)]
    assert images[0].shape == (1, 16, 16, 3) and np.isfinite(images[0]).all()
    call["generator"] = torch.Generator().manual_seed(0)
    assert np.array_equal(pipeline("a red circle on a white background", **call).images, images[0])
    assert not np.array_equal(images[0], images[1]), "the generator's second draw gives another image"


def test_the_tokenizers_split_a_caption_into_its_words(tmp_path):
    from transformers import AutoTokenizer

    folder = save_pipeline("sd3", tmp_path / "sd3")
    clip = AutoTokenizer.from_pretrained(folder / "tokenizer")
    t5 = AutoTokenizer.from_pretrained(folder / "tokenizer_3")
    caption = "a red circle on a white background"
    assert clip.convert_ids_to_tokens(clip(caption).input_ids)[1:-1] == [w + "</w>" for w in caption.split()]
    assert t5.convert_ids_to_tokens(t5(caption).input_ids)[:-1] == ["▁" + w for w in caption.split()]
    assert t5.decode(t5(caption + ", 3 squares!").input_ids, skip_special_tokens=True) == caption + ", 3 squares!"
