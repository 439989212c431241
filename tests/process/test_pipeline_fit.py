"""`lit-dist fit` of a pretrained diffusers pipeline named by one key, `pipeline.path`, for every family: the
denoiser, the objective with the folder's own schedule, and the caches of its VAE and text encoders come from the
folder; the run's saved config.yaml resumes as it is; a config that contradicts the folder is one line, exit 2; a
changed text encoder makes the caption cache stale."""

import shutil

import pytest
import torch
import yaml

from tests.conftest import lit_dist

pytestmark = pytest.mark.process
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path_factory.mktemp("shapes") / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=48, seed=1)
    return path


def _args(folder, shapes, root, cache, steps: int = 4) -> list[str]:
    return ["--pipeline.path", str(folder), "--data.metadata", str(shapes), "--data.resolution", "32",
            "--data.batch_size_per_device", "4", "--data.num_workers", "0", "--data.allow_oversubscription", "true",
            "--data.cache.dir", str(cache), "--run.root_dir", str(root), "--run.name", "ft", "--run.run_id", "r",
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "2",
            "--samples.num_prompts", "2", "--samples.per_prompt", "1", "--samples.steps", "2"]


# What each tiny folder's scheduler/ says (tests/helpers/pipelines.py), as the run's objective must have it.
SCHEDULE = {
    "sd15": ("Diffusion", {"prediction": "epsilon", "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                           "beta_end": 0.012}),
    "sdxl": ("Diffusion", {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}),
    "sd3": ("FlowMatching", {"shift": 3.0, "dynamic_shift": False}),
    "flux": ("FlowMatching", {"shift": 1.0, "dynamic_shift": True, "base_shift": 0.5, "max_shift": 1.15}),
    "pixart": ("Diffusion", {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_folder_trains_samples_and_resumes_from_its_saved_config(family, shapes, tmp_path):
    """Every family trains and samples; SDXL and Flux also resume from the saved config, export and sample again."""
    folder = save_pipeline(family, tmp_path / family)
    # SD3's run also masks its loss (the demo's images have no alpha: masks that count everywhere), cached on the
    # VAE's grid beside its latents.
    masks = ["--data.alpha_mask", "true"] if family == "sd3" else []
    out = lit_dist("fit", *_args(folder, shapes, tmp_path, tmp_path / "cache"), *masks)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("mask: 48 of 48 cached" in out.stdout + out.stderr) == (family == "sd3")
    run = tmp_path / "ft" / "r"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    model = saved["model"]["init_args"]
    assert model["net"]["class_path"] == "lit_dist.model.nets.pipeline.PipelineDenoiser"
    assert model["input_key"] == "latent"
    name, schedule = SCHEDULE[family]
    assert model["objective"]["class_path"].endswith(name)
    assert {k: model["objective"]["init_args"][k] for k in schedule} == schedule
    cache = saved["data"]["init_args"]["cache"]
    assert cache["caption_encoder"]["class_path"].endswith("PipelineTextEncoder") and cache["pixels"] is False
    assert saved["data"]["init_args"]["size_conditions"] is (family == "sdxl"), "SDXL's time_ids from each image"
    assert (run / "samples" / "step-000000004.png").exists()
    assert "caption_encoder: 48 of 48 cached" in out.stdout + out.stderr
    # lit-dist's lines only: no loading bar of transformers' or diffusers', no bar of its own in a pipe ("%|" is
    # tqdm's), no notice about torchvision (lit_dist.watch.console.quiet_loading and counter).
    for noise in ("Loading weights", "Loading pipeline components", "requires torchvision", "%|"):
        assert noise not in out.stdout + out.stderr, noise

    if family not in ("sdxl", "flux"):  # the resume, export and sample of the two that CI's time allows
        return
    # The saved config names the folder and holds what it filled in: the same again, so it resumes as it is.
    out = lit_dist("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in (out.stdout + out.stderr).lower() and "step 6/6" in out.stdout + out.stderr
    assert "max_steps: 6" in (run / "config.yaml").read_text(), "an accepted resume records its own config"

    # Out as a pipeline folder diffusers loads, with its card, and drawn from with `lit-dist sample`.
    from diffusers import DiffusionPipeline

    out = lit_dist("export", str(run / "checkpoints"), "--output", str(tmp_path / "exported"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(diffusers)" in out.stdout
    card = (tmp_path / "exported" / "README.md").read_text()
    prompts = (run / "samples" / "step-000000006.txt").read_text().splitlines()
    assert len(prompts) == 2 and all(p in card for p in prompts)
    assert "- steps: 6, about 24 images seen (4 per step)" in card and str(folder) in card
    assert (tmp_path / "exported" / "samples.png").read_bytes() == (run / "samples" / "step-000000006.png").read_bytes()
    DiffusionPipeline.from_pretrained(tmp_path / "exported")
    # The end of each run wrote its weights as a folder too (export.filename: pipeline, filled in), the resume's in
    # place of the first run's: the same as the export of the last checkpoint.
    from safetensors.torch import load_file

    part = "unet" if family == "sdxl" else "transformer"
    ended, exported = (load_file(next((where / part).glob("*.safetensors"))) for where in (run / "pipeline",
                                                                                          tmp_path / "exported"))
    assert ended.keys() == exported.keys() and all(torch.equal(ended[k], exported[k]) for k in ended)
    assert "- steps: 6," in (run / "pipeline" / "README.md").read_text()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".pipeline")) == [], "nothing left beside it"
    # The checkpoint alone, as export takes it: the run config is its run directory's config.yaml.
    out = lit_dist("sample", str(run / "checkpoints"), "--prompt", "a red circle on a white background", "--num", "2",
                   "--steps", "2", "--output", str(tmp_path / "grid.png"))
    assert out.returncode == 0 and (tmp_path / "grid.png").exists(), out.stderr[-3000:]
    assert f"lit-dist sample: the run config {run / 'config.yaml'}" in out.stdout
    lone = shutil.copytree(next((run / "checkpoints").glob("step-*")), tmp_path / "lone" / "step")
    out = lit_dist("sample", str(lone), "--prompt", "a red circle")
    lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error")]
    assert out.returncode == 2 and len(lines) == 1 and "is in no run directory" in lines[0], out.stderr[-2000:]


def test_a_config_that_contradicts_the_folder_is_one_line(shapes, tmp_path):
    folder = save_pipeline("sd15", tmp_path / "sd15")
    base = _args(folder, shapes, tmp_path, tmp_path / "cache")
    cases = [
        (["--model.net", "lit_dist.model.nets.TinyUNet"], "model.net is set to lit_dist.model.nets.TinyUNet and "
                                                          "pipeline.path fills it: pipeline.path names the denoiser"),
        (["--model.objective", "lit_dist.model.objectives.FlowMatching"], "is a sd15 pipeline, trained with a DDPM "
                                                                          "noise schedule (diffusion)"),
        (["--data.cache.dir", "null"], "set data.cache.dir"),
        (["--data.mean", "[0.4, 0.4, 0.4]"], "a pipeline's VAE takes images in [-1, 1]"),
        (["--pipeline.path", str(tmp_path / "none")], "pipeline.path = "),
    ]
    for extra, message in cases:
        out = lit_dist("fit", *base, *extra)
        lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error")]
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], (extra, out.stderr[-2000:])
        assert "Traceback" not in out.stderr


def test_a_changed_text_encoder_makes_the_caption_cache_stale(shapes, tmp_path):
    folder = save_pipeline("pixart", tmp_path / "pixart")
    out = lit_dist("fit", *_args(folder, shapes, tmp_path, tmp_path / "cache", steps=1))
    assert out.returncode == 0, out.stderr[-3000:]
    changed = shutil.copytree(folder, tmp_path / "changed")
    weights = changed / "text_encoder" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(4096)  # the last weights: what a fine-tuned encoder changes
    weights.write_bytes(bytes(data))
    out = lit_dist("fit", *_args(changed, shapes, tmp_path, tmp_path / "cache", steps=1), "--data.cache.mode", "read",
                   "--run.run_id", "again")
    assert out.returncode == 3, out.stderr[-3000:]
    # The VAE is the same files at another path: its latents are kept; the captions are stale.
    assert "is incomplete for this run: caption_encoder: 0 of 48 cached" in out.stderr
    assert "differs in weights_files" in out.stderr and "init_args" not in out.stderr


def test_an_export_that_fills_the_disk_is_one_line_and_leaves_nothing(shapes, tmp_path):
    from tests.helpers.small_fs import tmpfs

    folder = save_pipeline("sd15", tmp_path / "sd15")
    out = lit_dist("fit", *_args(folder, shapes, tmp_path, tmp_path / "cache", steps=1))
    assert out.returncode == 0, out.stderr[-3000:]
    with tmpfs(tmp_path / "small", 256) as small:  # another filesystem: the components are copied, not linked
        out = lit_dist("export", str(tmp_path / "ft" / "r" / "checkpoints"), "--output", str(small / "exported"))
        assert out.returncode == 16, out.stderr[-3000:]
        lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error")]
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert list(small.iterdir()) == [], "a partial folder was left"


def test_a_hub_id_trains_from_its_cached_half_precision_snapshot_and_exports_a_plain_folder(shapes, tmp_path):
    """`pipeline.path: owner/name` as on a cluster whose Hugging Face cache holds a download with --variant fp16
    (HF_HUB_OFFLINE=1: nothing here reaches the network); an id that is not cached is one line, exit 2."""
    hub = tmp_path / "hf"
    repo = hub / "hub" / "models--lit-dist--tiny-sd15"
    save_pipeline("sd15", repo / "snapshots" / ("0" * 40), variant="fp16")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {"HF_HOME": str(hub), "HF_HUB_OFFLINE": "1"}
    out = lit_dist("fit", *_args("lit-dist/tiny-sd15", shapes, tmp_path, tmp_path / "cache", steps=2), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "ft" / "r" / "config.yaml").read_text())
    assert saved["pipeline"]["path"] == "lit-dist/tiny-sd15"
    assert saved["model"]["init_args"]["net"]["init_args"]["pipeline"] == str(repo / "snapshots" / ("0" * 40))

    # The frozen parts' fp16 files come out under the plain names: the folder loads without a variant.
    from diffusers import DiffusionPipeline

    out = lit_dist("export", str(tmp_path / "ft" / "r" / "checkpoints"), "--output", str(tmp_path / "exported"),
                   env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list((tmp_path / "exported").rglob("*.fp16.*"))
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "exported")
    assert pipeline.unet.dtype == torch.float32 and pipeline.text_encoder.dtype == torch.float16

    # The id's snapshot changed since (a newer download): the saved config names the old one; one line, exit 2.
    shutil.copytree(repo / "snapshots" / ("0" * 40), repo / "snapshots" / ("1" * 40))
    (repo / "refs" / "main").write_text("1" * 40)
    out = lit_dist("fit", "--config", str(tmp_path / "ft" / "r" / "config.yaml"), "--trainer.max_steps", "3", env=env)
    lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error")]
    assert out.returncode == 2 and len(lines) == 1 and "0" * 40 in lines[0] and "1" * 40 in lines[0], out.stderr[-2000:]

    out = lit_dist("fit", *_args("lit-dist/not-cached", shapes, tmp_path, tmp_path / "cache"), env=env)
    lines = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error")]
    assert out.returncode == 2 and len(lines) == 1 and "huggingface-cli download lit-dist/not-cached" in lines[0], \
        out.stderr[-2000:]


def test_a_lora_trains_resumes_and_leaves_its_adapter_alone_for_diffusers(shapes, tmp_path):
    """model.adapter: the run trains a LoRA on the frozen SDXL U-Net, its checkpoints hold the adapter and not the
    base, it resumes (and refuses to on another base), its end writes the adapter alone
    (pytorch_lora_weights.safetensors, with a card) that the family's pipeline loads with load_lora_weights;
    `lit-dist export --merge true` writes the whole pipeline with it merged, `lit-dist sample` scales it."""
    import shutil

    from diffusers import DiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import load_file

    from lit_dist.ckpt.export import load_checkpoint_state

    folder = save_pipeline("sdxl", tmp_path / "sdxl")
    adapter = ["--model.adapter.kind", "lora", "--model.adapter.rank", "4"]
    out = lit_dist("fit", *_args(folder, shapes, tmp_path, tmp_path / "cache"), *adapter)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "ft" / "r"
    assert (run / "samples" / "step-000000004.png").exists()
    saved = load_checkpoint_state(str(run / "checkpoints"))
    base = [k for k in saved if k.startswith("net.") and ".lora_" not in k]
    assert not base and saved["adapter_base"].shape == (32,), f"the checkpoint holds the base: {base[:3]}"
    out = lit_dist("fit", "--config", str(run / "config.yaml"), "--trainer.max_steps", "6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in (out.stdout + out.stderr).lower() and "step 6/6" in out.stdout + out.stderr
    assert "max_steps: 6" in (run / "config.yaml").read_text(), "an accepted resume records its own config"

    exported = run / "pipeline"
    weights = load_file(exported / "pytorch_lora_weights.safetensors")
    assert weights and all(k.startswith("unet.") and ".lora_" in k for k in weights), sorted(weights)[:3]
    assert all(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k), "the adapter never trained"
    card = (exported / "README.md").read_text()
    assert "An adapter (lora rank 4, alpha 4)" in card and "load_lora_weights" in card and "- steps: 6," in card
    assert not (exported / "unet").exists(), "the base is not copied: the adapter alone"
    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.load_lora_weights(str(exported))
    assert pipeline.unet.peft_config, "diffusers put no adapter into the U-Net"
    # `lit-dist export` of the last checkpoint writes the same adapter (its base not loaded: only its names needed).
    out = lit_dist("export", str(run / "checkpoints"), "--output", str(tmp_path / "exported"))
    assert out.returncode == 0, out.stderr[-3000:]
    again = load_file(tmp_path / "exported" / "pytorch_lora_weights.safetensors")
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert "load_lora_weights" in (tmp_path / "exported" / "README.md").read_text()
    out = lit_dist("export", str(run / "checkpoints"), "--output", str(tmp_path / "merged"), "--merge", "true")
    assert out.returncode == 0, out.stderr[-3000:]
    merged = DiffusionPipeline.from_pretrained(tmp_path / "merged").unet.state_dict()
    plain = DiffusionPipeline.from_pretrained(folder).unet.state_dict()
    q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    assert merged.keys() == plain.keys() and not torch.equal(merged[q], plain[q]), "nothing merged"
    out = lit_dist("sample", "--config", str(run / "config.yaml"), "--checkpoint", str(run / "checkpoints"),
                   "--prompt", "a red circle", "--num", "1", "--steps", "2", "--adapter_scale", "0.5", "--output",
                   str(tmp_path / "half.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the adapter at scale 0.5" in out.stdout and (tmp_path / "half.png").is_file()
    # Another base (this pipeline with its U-Net fine-tuned; its encoders, and so the caches, the same): refused.
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    unet = UNet2DConditionModel.from_pretrained(other / "unet")
    with torch.no_grad():
        unet.conv_in.weight.mul_(1.01)
    unet.save_pretrained(other / "unet")
    out = lit_dist("fit", *_args(other, shapes, tmp_path, tmp_path / "cache", steps=8), *adapter)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"holds an adapter trained on another base (the pipeline folder {folder}) than this run's model.net" \
        in out.stderr.strip().splitlines()[-1]
    # The refused resume leaves the config.yaml the checkpoint was saved with: it still names the right base.
    assert f"path: {folder}" in (run / "config.yaml").read_text() and str(other) not in (run / "config.yaml").read_text()
