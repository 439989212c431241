"""A pipeline folder's text encoders, as the caption cache runs them, give what the family's own diffusers pipeline
gives for the same prompt (its encode_prompt): SDXL's penultimate states of two CLIPs and the second's pooled
projection, SD3's padded CLIP states before the T5's, Flux's CLIP pooled output and T5 states, PixArt's T5 states and
mask of a lowercased prompt."""

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.encoders import PipelineTextEncoder  # noqa: E402
from lit_dist.errors import ConfigError  # noqa: E402
from lit_dist.model.nets.pipeline import CONDITION  # noqa: E402
from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402

PROMPTS = ["a red circle on a white background", "A Blue Square on a yellow background"]
TOKENS = 16


def _pipeline_encodes(family: str, pipeline) -> dict:
    """The family's condition as its pipeline encodes PROMPTS."""
    device = torch.device("cpu")
    if family == "sd15":
        hidden, _ = pipeline.encode_prompt(PROMPTS, device, 1, False)
        return {"hidden": hidden}
    if family == "sdxl":
        hidden, _, pooled, _ = pipeline.encode_prompt(PROMPTS, device=device, do_classifier_free_guidance=False)
        return {"hidden": hidden, "pooled": pooled}
    if family == "sd3":
        hidden, _, pooled, _ = pipeline.encode_prompt(PROMPTS, None, None, device=device, do_classifier_free_guidance=False,
                                                      max_sequence_length=TOKENS)
        return {"hidden": hidden, "pooled": pooled}
    if family == "flux":
        hidden, pooled, _ = pipeline.encode_prompt(PROMPTS, None, device=device, max_sequence_length=TOKENS)
        return {"hidden": hidden, "pooled": pooled}
    hidden, mask, _, _ = pipeline.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device=device,
                                                clean_caption=False, max_sequence_length=TOKENS)
    return {"hidden": hidden, "mask": mask}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_captions_encode_as_the_family_s_pipeline_encodes_them(family, tmp_path):
    from diffusers import DiffusionPipeline

    folder = save_pipeline(family, tmp_path / family)
    expected = _pipeline_encodes(family, DiffusionPipeline.from_pretrained(folder))
    encoder = PipelineTextEncoder(str(folder), max_length=TOKENS).eval()
    with torch.no_grad():
        got = encoder(PROMPTS)
    assert set(got) == set(expected) == set(CONDITION[family])
    for key in expected:
        torch.testing.assert_close(got[key].to(expected[key].dtype), expected[key], msg=f"{family} {key}")
    assert not torch.equal(got["hidden"][0], got["hidden"][1]), "two captions, two encodings"


def test_a_t5_length_below_one_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="max_length = 0: must be at least 1"):
        PipelineTextEncoder(str(save_pipeline("pixart", tmp_path / "pixart")), max_length=0)
