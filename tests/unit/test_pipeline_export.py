"""A fine-tuned pipeline leaves lit-dist as a folder diffusers loads: ``write_pipeline`` puts the run's denoiser
weights into a copy of the base folder, and the family's own pipeline loaded from it, given the same prompts, noise,
steps and guidance, draws the images lit-dist's sampler draws with the run's weights (the pipeline encoding the
prompts itself, its VAE decoding)."""

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.encoders import PipelineTextEncoder, VAEDecoder  # noqa: E402
from lit_dist.errors import ConfigError  # noqa: E402
from lit_dist.model.nets.pipeline import PipelineDenoiser, write_pipeline  # noqa: E402
from lit_dist.model.objectives import Diffusion, FlowMatching  # noqa: E402
from lit_dist.model.sampling import decode, initial_noise, sample  # noqa: E402
from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402

PROMPTS = ["a red circle on a white background", "a blue square on a yellow background"]
TOKENS, STEPS, GUIDANCE = 16, 3, 2.5


def _trained(folder) -> PipelineDenoiser:
    """The folder's denoiser with every weight moved, as a run leaves it."""
    net = PipelineDenoiser(str(folder)).eval()
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
    return net


def _their_images(family: str, pipeline, noise: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1]: the family's ``pipeline`` (DiffusionPipeline.from_pretrained of a folder), encoding
    PROMPTS itself."""
    pipeline.set_progress_bar_config(disable=True)
    b, c, h, w = noise.shape
    call = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "output_type": "pt",
            "height": h * pipeline.vae_scale_factor, "width": w * pipeline.vae_scale_factor,
            "generator": torch.Generator().manual_seed(0), "latents": noise}
    if family in ("sd3", "flux", "pixart"):
        call["max_sequence_length"] = TOKENS
    if family == "flux":
        call["latents"] = type(pipeline)._pack_latents(noise, b, c, h, w)
    if family == "pixart":
        call.update(use_resolution_binning=False, clean_caption=False)
    with torch.no_grad():
        return pipeline(PROMPTS, **call).images


@pytest.mark.parametrize("family", FAMILIES)
def test_the_exported_folder_draws_what_lit_dist_draws_with_the_run_s_weights(family, tmp_path):
    from diffusers import DiffusionPipeline

    base = save_pipeline(family, tmp_path / "base")
    net = _trained(base)
    out = write_pipeline(str(base), {f"model.{k}": v for k, v in net.model.state_dict().items()}, str(tmp_path / "out"))

    vae = "vae/diffusion_pytorch_model.safetensors"
    assert (out / vae).stat().st_ino == (base / vae).stat().st_ino, "the frozen parts linked, not copied"
    loaded = getattr(DiffusionPipeline.from_pretrained(out), net.folder.family.denoiser)
    for name, value in net.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    base_weights = getattr(DiffusionPipeline.from_pretrained(base), net.folder.family.denoiser).state_dict()
    assert any(not torch.equal(base_weights[k], v) for k, v in net.model.state_dict().items())

    noise = initial_noise((4, 8, 8), 0, range(len(PROMPTS)))
    ours = _our_images(net, base, noise)
    theirs = _their_images(family, DiffusionPipeline.from_pretrained(out), noise)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.float(), atol=1.5 / 255, rtol=0)
    assert (ours[0] - ours[1]).abs().mean() > 1e-3, "two prompts, two images"


def _our_images(net: PipelineDenoiser, folder, noise: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1]: lit-dist's sampler with ``net``, the prompts encoded and decoded by ``folder``'s own
    text encoders and VAE, as a run's samples are."""
    encoder = PipelineTextEncoder(str(folder), max_length=TOKENS).eval()
    with torch.no_grad():
        condition, empty = encoder(PROMPTS), encoder.empty_caption()
    objective = FlowMatching() if net.folder.family.flow else Diffusion()
    objective.bind("latent", "label")
    latents = sample(net, objective, condition, noise, steps=STEPS, guidance=GUIDANCE, empty=empty)
    half = torch.full((1, 3, 1, 1), 127.5)
    return decode(latents, VAEDecoder(pretrained=str(folder), subfolder="vae").eval(), half, half).float() / 255


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_an_exported_lora_draws_in_the_family_s_pipeline_what_lit_dist_draws_with_it(family, tmp_path):
    """The base pipeline with the exported LoRA loaded by ``load_lora_weights`` draws, prompt for prompt, the
    images lit-dist's sampler draws with the adapter on its denoiser."""
    from diffusers import DiffusionPipeline

    from lit_dist.model.adapter_export import write_adapter
    from lit_dist.model.adapters import Adapter

    base = save_pipeline(family, tmp_path / "base")
    net = PipelineDenoiser(str(base)).eval()
    adapter = Adapter(kind="lora", rank=4)
    adapter.attach(net)
    with torch.no_grad():  # a trained adapter: its factors away from their zero start
        for i, p in enumerate(p for p in net.parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
    write_adapter(net.folder, net.model, adapter, {f"model.{k}": v for k, v in net.model.state_dict().items()},
                  str(tmp_path / "lora"))
    noise = initial_noise((4, 8, 8), 0, range(len(PROMPTS)))
    ours = _our_images(net, base, noise)
    pipeline = DiffusionPipeline.from_pretrained(base)
    plain = _their_images(family, pipeline, noise)
    pipeline.load_lora_weights(str(tmp_path / "lora"))
    theirs = _their_images(family, pipeline, noise)
    torch.testing.assert_close(ours, theirs.float(), atol=1.5 / 255, rtol=0)
    assert (plain - theirs).abs().max() > 4 / 255, "the adapter changed no image"


def test_an_existing_output_or_a_network_of_another_pipeline_is_one_line(tmp_path):
    base = save_pipeline("sd15", tmp_path / "base")
    (tmp_path / "there").mkdir()
    with pytest.raises(ConfigError, match="--output .*there' exists: remove it, or name a new folder"):
        write_pipeline(str(base), {}, str(tmp_path / "there"))
    with pytest.raises(ConfigError, match="does not fit .*unet: .* missing .*was the run trained from another pipeline"):
        write_pipeline(str(base), {"model.other.weight": torch.zeros(1)}, str(tmp_path / "new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "there"], "nothing left of the failed export"


def test_a_replaced_folder_is_whole_and_what_a_killed_export_left_is_removed(tmp_path):
    """replace=True (the end of a resumed run) swaps the folder once the new one is whole; the half-written folders
    of an export killed mid-way (its process gone) go, those of a running one stay."""
    import os
    import socket
    import subprocess
    import sys

    base = save_pipeline("sd15", tmp_path / "base")
    net = PipelineDenoiser(str(base))
    weights = {f"model.{k}": v for k, v in net.model.state_dict().items()}
    write_pipeline(str(base), weights, str(tmp_path / "out"))
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    host = socket.gethostname()
    left = [tmp_path / f".out.partial-{host}-{dead}-0a1b2c3d", tmp_path / f".out.old-{host}-{dead}-0a1b2c3d"]
    running = tmp_path / f".out.partial-{host}-{os.getpid()}-4e5f6a7b"
    for path in (*left, running):
        (path / "unet").mkdir(parents=True)
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}
    write_pipeline(str(base), changed, str(tmp_path / "out"), replace=True)
    loaded = PipelineDenoiser(str(tmp_path / "out")).model.state_dict()
    assert all(torch.equal(loaded[k.removeprefix("model.")], v) for k, v in changed.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["base", "out", running.name])
