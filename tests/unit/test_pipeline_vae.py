"""A pipeline folder's VAE and text encoders as the caches use them: latents made as the family's own pipeline makes
them (SD3's and Flux's shift factor included) and decoded back as it decodes them; encoders named by their files,
so that a copy of the folder elsewhere keeps the cache and any changed file makes it stale, without reading the
weights whole."""

import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.encoders import PipelineTextEncoder, VAEDecoder, VAEEncoder  # noqa: E402
from lit_dist.cache.pipelines import SAMPLE_BYTES, files_fingerprint  # noqa: E402
from tests.helpers.pipelines import save_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return save_pipeline("flux", tmp_path_factory.mktemp("pipelines") / "flux")


def test_latents_are_shifted_and_scaled_as_the_flux_pipeline_makes_them_and_decode_back(flux):
    from diffusers import FluxImg2ImgPipeline

    pipeline = FluxImg2ImgPipeline.from_pretrained(flux)
    assert pipeline.vae.config.shift_factor == pytest.approx(0.1159)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    encoder = VAEEncoder(pretrained=str(flux), subfolder="vae", output="sample", seed=5).eval()
    with torch.no_grad():
        ours = encoder(images)
        theirs = pipeline._encode_vae_image(images, torch.Generator().manual_seed(5))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        # FluxPipeline's decode: latents / scaling factor + shift factor.
        decoded = VAEDecoder(pretrained=str(flux), subfolder="vae").eval()(ours)
        expected = pipeline.vae.decode(ours / pipeline.vae.config.scaling_factor + pipeline.vae.config.shift_factor).sample
    torch.testing.assert_close(decoded, expected, rtol=0, atol=0)
    without = ours / 0.3611 + 0.1159  # what a VAE without the shift would have been given
    assert (without - ours / 0.3611).abs().min() > 0.1


def test_encoders_from_a_folder_are_named_by_their_files_the_same_elsewhere_and_changed_by_any_file(flux, tmp_path):
    before = PipelineTextEncoder.files_fingerprint(str(flux), 8), VAEEncoder.files_fingerprint(str(flux), "vae")
    assert before[0] != before[1]

    copy = shutil.copytree(flux, tmp_path / "copy")  # another path, other modification times: the same files
    assert (PipelineTextEncoder.files_fingerprint(str(copy), 8), VAEEncoder.files_fingerprint(str(copy), "vae")) == before

    weights = copy / "text_encoder_2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(4096)  # one block of weights, well inside the file
    weights.write_bytes(bytes(data))
    assert PipelineTextEncoder.files_fingerprint(str(copy), 8) != before[0]
    assert VAEEncoder.files_fingerprint(str(copy), "vae") == before[1]

    (copy / "tokenizer" / "tokenizer.json").write_text((flux / "tokenizer" / "tokenizer.json").read_text().replace("red", "rod"))
    assert files_fingerprint(copy, ["tokenizer"]) != files_fingerprint(flux, ["tokenizer"])


def test_a_weight_file_is_read_in_samples_not_whole(tmp_path, monkeypatch):
    import builtins

    big = tmp_path / "enc" / "model.safetensors"
    big.parent.mkdir()
    big.write_bytes(b"\x00" * (64 * SAMPLE_BYTES))
    read = []
    real_open = builtins.open

    class Counted:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def read(self, n=-1):
            out = self.file.read(n)
            read.append(len(out))
            return out

        def seek(self, offset):
            return self.file.seek(offset)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(builtins, "open", Counted)
    files_fingerprint(tmp_path, ["enc"])
    monkeypatch.undo()
    assert 0 < sum(read) <= 16 * SAMPLE_BYTES + 8, "the header and 16 samples, not the 4 MB file"
