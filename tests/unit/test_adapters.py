"""model.adapter: LoRA, LoHa and LoKr put into a pipeline's frozen denoiser: they start as the base, and only they
train."""

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from lit_dist.errors import ConfigError  # noqa: E402
from lit_dist.model.adapters import Adapter  # noqa: E402
from lit_dist.model.module import LitModel  # noqa: E402
from lit_dist.model.nets.pipeline import PipelineDenoiser  # noqa: E402
from tests.helpers.pipelines import FAMILIES, save_pipeline  # noqa: E402
from tests.unit.test_module import attach  # noqa: E402
from tests.unit.test_pipeline_denoiser import _as_lit_dist_call, _pipeline_call  # noqa: E402

ADAPTER_KEYS = ("lora_", "hada_", "lokr_")


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """Per family: its tiny folder and one call of its denoiser as its pipeline makes it (x_t, timestep, condition)."""
    out = {}
    for family in FAMILIES:
        folder = save_pipeline(family, tmp_path_factory.mktemp(family) / family)
        out[family] = (folder, _as_lit_dist_call(family, *_pipeline_call(family, folder))[:3])
    return out


@pytest.mark.parametrize("family,kind", [(f, "lora") for f in FAMILIES] +
                         [(f, k) for f in ("sdxl", "flux") for k in ("loha", "lokr")])
def test_an_adapter_starts_as_the_base_and_only_it_trains(calls, family, kind):
    folder, (x, timestep, condition) = calls[family]
    net = PipelineDenoiser(str(folder))
    with torch.no_grad():
        before = net(x, timestep, condition)
    base = {name: p.detach().clone() for name, p in net.named_parameters()}
    model = attach(LitModel(net, adapter=Adapter(kind=kind, rank=4), lr_scaling="none",
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2)))
    trained = {name for name, p in net.named_parameters() if p.requires_grad}
    assert trained and all(any(key in name for key in ADAPTER_KEYS) for name in trained), sorted(trained)[:4]
    assert set(base) <= {name.replace(".base_layer", "") for name, _ in net.named_parameters()}
    with torch.no_grad():  # an update that starts at zero: the base's outputs
        torch.testing.assert_close(net(x, timestep, condition), before)

    optimizer = model.configure_optimizers()
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert ids == {id(p) for name, p in net.named_parameters() if name in trained}
    for _ in range(2):
        optimizer.zero_grad()
        net(x, timestep, condition).square().mean().backward()
        optimizer.step()
    for name, p in net.named_parameters():
        if name not in trained:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), f"{name}: a frozen weight moved"
    with torch.no_grad():
        assert not torch.allclose(net(x, timestep, condition), before), "the adapter did not change the outputs"


def test_a_wrong_adapter_is_one_line_naming_the_field(calls):
    folder, _ = calls["sdxl"]
    with pytest.raises(ConfigError, match=r"target_modules: the sdxl denoiser has no layer named to_qq: name layers it "
                                          r"has \(e\.g\. .*to_q"):
        Adapter(target_modules=["to_q", "to_qq"]).attach(PipelineDenoiser(str(folder)))
    # A text encoder's layers (kohya's and diffusers' --train_text_encoder): why they are not there.
    with pytest.raises(ConfigError, match=r"no layer named q_proj, fc1 \(adapters go into the denoiser only: its "
                                          r"captions come from the cache, encoded once by the frozen text encoders\)"):
        Adapter(target_modules=["to_q", "q_proj", "fc1"]).attach(PipelineDenoiser(str(folder)))
    with pytest.raises(ConfigError, match=r"model.adapter.rank = 0: must be at least 1(.|\n)*use_dora is LoRA's; kind "
                                          r"is 'lokr'"):
        Adapter(kind="lokr", rank=0, use_dora=True)
    with pytest.raises(ConfigError, match=r"model.adapter.kind = 'ia3': must be one of lora, loha, lokr"):
        Adapter(kind="ia3")


@pytest.mark.parametrize("family,kind", [(f, "lora") for f in FAMILIES] + [("sdxl", "dora"), ("flux", "dora"),
                                                                             ("sdxl", "lokr"), ("flux", "loha")])
def test_the_exported_adapter_loads_into_the_family_s_pipeline_and_computes_the_same(calls, family, kind, tmp_path):
    from diffusers import DiffusionPipeline

    from lit_dist.model.adapter_export import LORA_FILE, PEFT_FILES, write_adapter

    folder, (x, timestep, condition) = calls[family]
    net = PipelineDenoiser(str(folder))
    adapter = Adapter(kind="lora", rank=4, use_dora=True) if kind == "dora" else Adapter(kind=kind, rank=4)
    adapter.attach(net)
    with torch.no_grad():  # a trained adapter: its factors away from their zero start
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
        expected = net(x, timestep, condition)
    kind_written = write_adapter(net.folder, net.model, adapter,
                                 {f"model.{k}": v for k, v in net.model.state_dict().items()}, str(tmp_path / "adapter"))
    pipeline = DiffusionPipeline.from_pretrained(folder)
    denoiser = "unet" if family in ("sd15", "sdxl") else "transformer"
    if kind in ("lora", "dora") and family != "pixart":
        assert kind_written == "diffusers" and (tmp_path / "adapter" / LORA_FILE).is_file()
        pipeline.load_lora_weights(str(tmp_path / "adapter"))
    else:  # peft's format, as the model card loads it
        from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        assert kind_written == "peft" and all((tmp_path / "adapter" / f).is_file() for f in PEFT_FILES)
        model = getattr(pipeline, denoiser)
        inject_adapter_in_model(PeftConfig.from_pretrained(str(tmp_path / "adapter")), model)
        set_peft_model_state_dict(model, load_file(str(tmp_path / "adapter" / PEFT_FILES[1])))
    loaded = PipelineDenoiser(str(folder))
    loaded.model = getattr(pipeline, denoiser)
    with torch.no_grad():
        got = loaded.eval()(x, timestep, condition)
        torch.testing.assert_close(got, expected.detach())
        base = PipelineDenoiser(str(folder)).eval()(x, timestep, condition)
    assert not torch.allclose(got, base), "the loaded adapter changed nothing"


def test_a_checkpoint_holds_the_adapter_and_refuses_another_base(calls):
    """The state a checkpoint gets is the adapter and the base's fingerprint: it loads onto a new model of the same
    base (the base from the folder, the adapter from the state), is one line (exit 2) on another base, and a state
    that holds the base (as checkpoints did before) loads too."""
    folder, (x, timestep, condition) = calls["sdxl"]

    def model():
        return LitModel(PipelineDenoiser(str(folder)), adapter=Adapter(rank=4), lr_scaling="none")

    trained = model()
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    state = trained.state_dict()
    adapter = {n for n, p in trained.named_parameters() if p.requires_grad}
    assert {k for k in state if k.startswith("net.")} == adapter and state["adapter_base"].shape == (32,)

    again = model()
    again.check_base(state["adapter_base"], "ckpt")
    again.load_state_dict(state, strict=True)  # the base's names may be missing, nothing else
    with torch.no_grad():
        torch.testing.assert_close(again.net(x, timestep, condition), trained.net(x, timestep, condition))
    with pytest.raises(RuntimeError, match="Missing key"):  # the adapter's may not
        model().load_state_dict({k: v for k, v in state.items() if "lora_A" not in k}, strict=True)

    net = PipelineDenoiser(str(folder))
    with torch.no_grad():
        next(net.parameters()).mul_(1.01)  # a fine-tuned base: one tensor of it
    other = LitModel(net, adapter=Adapter(rank=4), lr_scaling="none")
    with pytest.raises(ConfigError, match="the checkpoint ckpt holds an adapter trained on another base than this "
                                          "run's model.net"):
        other.check_base(state["adapter_base"], "ckpt")

    whole = {**state, **{f"net.{k}": v for k, v in trained.net.state_dict().items()}}  # the base in it too
    older = model()
    older.check_base(None, "ckpt")  # such a checkpoint has no fingerprint: its base is its own
    older.load_state_dict(whole, strict=True)


def test_an_adapter_trains_on_the_base_model_init_weights_gives_and_a_checkpoint_names_it(calls, tmp_path):
    """A base fine-tuned before (model.init_weights over the folder's denoiser: a diffusers model's own file, as a
    community fine-tune of a U-Net is shared) is the adapter's base: its weights are the frozen ones, and the
    checkpoint's fingerprint is of it, so a resume on the folder's own base is refused."""
    folder, _ = calls["sdxl"]
    tuned = PipelineDenoiser(str(folder))
    with torch.no_grad():
        for p in tuned.parameters():
            p.mul_(1.5)
    tuned.model.save_pretrained(tmp_path / "unet")  # names without the denoiser's "model." prefix
    path = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"

    model = LitModel(PipelineDenoiser(str(folder)), adapter=Adapter(rank=4), lr_scaling="none", init_weights=str(path))
    frozen = {n.replace(".base_layer", ""): p for n, p in model.net.named_parameters() if not p.requires_grad}
    assert frozen and all(torch.equal(p, tuned.state_dict()[n]) for n, p in frozen.items())
    plain = LitModel(PipelineDenoiser(str(folder)), adapter=Adapter(rank=4), lr_scaling="none")
    with pytest.raises(ConfigError, match="holds an adapter trained on another base than this run's model.net"):
        plain.check_base(model.state_dict()["adapter_base"], "ckpt")
    again = LitModel(PipelineDenoiser(str(folder)), adapter=Adapter(rank=4), lr_scaling="none", init_weights=str(path))
    again.check_base(model.state_dict()["adapter_base"], "ckpt")

    # --merge: into that base (the run's config names the file), not the folder's own, which is refused.
    from lit_dist.model.adapter_export import adapter_card, merged_weights

    x, timestep, condition = calls["sdxl"][1]
    with torch.no_grad():
        for p in model.net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    state, fingerprint = {k.removeprefix("net."): v for k, v in model.state_dict().items() if k.startswith("net.")}, \
        model.state_dict()["adapter_base"]
    merged = PipelineDenoiser(str(folder))
    merged.load_state_dict(merged_weights(model.net.folder, Adapter(rank=4), state, fingerprint, 1.0, str(path)))
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(x, timestep, condition), model.net.eval()(x, timestep, condition),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match="is not the base the adapter was trained on"):
        merged_weights(model.net.folder, Adapter(rank=4), state, fingerprint)
    described, lines = adapter_card(Adapter(rank=4), model.net.folder, str(tmp_path / "lora"), "diffusers", str(path))
    assert described.endswith(f"on a unet started from {path}") and "load them into pipeline.unet first" in lines[2]


@pytest.mark.parametrize("family,kind", [("sdxl", "dora"), ("flux", "lokr")])
def test_a_merged_export_is_the_base_plus_the_adapter_at_its_scale(calls, family, kind, tmp_path):
    """--merge: the pipeline folder written with the adapter merged into the base's weights computes what the base
    with the adapter computes, at scale 1 and at another; an adapter on another base is refused."""
    from diffusers import DiffusionPipeline

    from lit_dist.model.adapter_export import merged_weights
    from lit_dist.model.adapters import base_fingerprint, base_names, scaled
    from lit_dist.model.nets.pipeline import write_pipeline

    folder, (x, timestep, condition) = calls[family]
    adapter = Adapter(kind="lora", rank=4, use_dora=True) if kind == "dora" else Adapter(kind=kind, rank=4)
    net = PipelineDenoiser(str(folder))
    adapter.attach(net)
    fingerprint = base_fingerprint(net, base_names(net))
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in net.state_dict().items() if k not in base_names(net)}  # as a checkpoint holds it
    denoiser = "unet" if family == "sdxl" else "transformer"
    for scale in (1.0, 0.5):
        out = write_pipeline(str(folder), merged_weights(net.folder, adapter, state, fingerprint, scale),
                             str(tmp_path / f"merged-{scale}"))
        loaded = PipelineDenoiser(str(folder))
        loaded.model = getattr(DiffusionPipeline.from_pretrained(out), denoiser)
        with torch.no_grad(), scaled(net, scale):
            torch.testing.assert_close(loaded.eval()(x, timestep, condition), net.eval()(x, timestep, condition),
                                       rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        base = PipelineDenoiser(str(folder)).eval()(x, timestep, condition)
        assert not torch.allclose(loaded(x, timestep, condition), base), "the merge changed nothing"
        if kind != "dora":  # DoRA's trained magnitudes stay at scale 0
            with scaled(net, 0.0):  # scale 0: the base alone
                torch.testing.assert_close(net(x, timestep, condition), base)
    with pytest.raises(ConfigError, match="is not the base the adapter was trained on"):
        merged_weights(net.folder, adapter, state, fingerprint.flip(0))


# Flux's LoRA in the tiny pipeline: on the double block's layers alone. diffusers' reader of kohya's Flux files splits
# a single block's fused linear1 at Flux.1's sizes (3072 and 12288), which the next test checks at those sizes.
KOHYA_TARGETS = {"sd15": None, "sdxl": None,
                 "flux": ["attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_out.0",
                          "ff.net.0.proj", "ff_context.net.2", "norm1.linear"]}


@pytest.mark.parametrize("family", sorted(KOHYA_TARGETS))
def test_a_kohya_export_loads_into_the_family_s_pipeline_and_computes_the_same(calls, family, tmp_path):
    """--format kohya: one file of lora_unet_* names (lora_down, lora_up, alpha), which diffusers' load_lora_weights
    reads with its converter of kohya's files (as ComfyUI reads them): the same outputs as lit-dist's. Flux's text
    attention is one fused layer there, its k part (not adapted) zero."""
    from diffusers import DiffusionPipeline
    from safetensors import safe_open

    from lit_dist.model.adapter_export import write_adapter

    folder, (x, timestep, condition) = calls[family]
    net = PipelineDenoiser(str(folder))
    targets = KOHYA_TARGETS[family]
    adapter = Adapter(kind="lora", rank=4, alpha=2, target_modules=targets)  # a scale of 0.5: the alpha must travel
    adapter.attach(net)
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
        expected = net(x, timestep, condition)
    out = tmp_path / "shapes-lora"
    assert write_adapter(net.folder, net.model, adapter, {f"model.{k}": v for k, v in net.model.state_dict().items()},
                         str(out), kohya=True) == "kohya"
    with safe_open(str(out / "shapes-lora.safetensors"), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
                        for k in keys), keys[:4]
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2"
    if family == "flux":
        assert {k.split(".")[0] for k in keys} == {f"lora_unet_double_blocks_0_{n}" for n in (
            "txt_attn_qkv", "txt_attn_proj", "img_attn_proj", "img_mlp_0", "txt_mlp_2", "img_mod_lin")}
    pipeline = DiffusionPipeline.from_pretrained(folder)
    pipeline.load_lora_weights(str(out), weight_name="shapes-lora.safetensors")
    loaded = PipelineDenoiser(str(folder))
    loaded.model = getattr(pipeline, net.folder.family.denoiser)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x, timestep, condition), expected)


def test_flux_s_kohya_names_fuse_its_projections_as_diffusers_reads_them_at_flux_1_s_sizes(tmp_path):
    """A LoRA on every linear layer of Flux.1-dev's shapes but a single block's MLP input, named as kohya's files
    name it and read back by diffusers' loader of them: each layer's update as trained (the final layer's too,
    which that loader reads without its alpha), and none for the fused layer's part left out."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from safetensors.torch import save_file

    from lit_dist.model.kohya import kohya_names

    with torch.device("meta"):  # Flux.1-dev's shapes (3072 wide, guidance embedded), without its weights
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    generator = torch.Generator().manual_seed(0)
    layers, rank, mlp = {}, 4, "single_transformer_blocks.0.proj_mlp"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != mlp:
            layers[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator)
            layers[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator)
    file = tmp_path / "flux-lora.safetensors"
    save_file(kohya_names(layers, Adapter(rank=rank, alpha=2), "flux", model), str(file))

    read = FluxPipeline.lora_state_dict(str(file))
    read = {k.removeprefix("transformer."): v for k, v in read.items()}

    def update(factors: dict, module: str, v: torch.Tensor) -> torch.Tensor:  # B @ A @ v: the update on inputs v
        return factors[f"{module}.lora_B.weight"] @ (factors[f"{module}.lora_A.weight"] @ v)

    for key in [k for k in layers if k.endswith(".lora_A.weight")]:
        module = key.removesuffix(".lora_A.weight")
        v = torch.randn(layers[key].shape[1], 2, generator=generator)
        torch.testing.assert_close(update(read, module, v), update(layers, module, v) * 0.5, msg=module)
    assert len(layers) == 2 * 29 and not update(read, mlp, torch.randn(3072, 2, generator=generator)).any()
    assert {k.removesuffix(".lora_A.weight") for k in read if k.endswith("lora_A.weight")} == \
        {k.removesuffix(".lora_A.weight") for k in layers if k.endswith("lora_A.weight")} | {mlp}


def test_kohya_s_names_are_refused_where_they_would_not_load(calls, tmp_path):
    from lit_dist.model.adapter_export import write_adapter

    for family, adapter, says in (("sd3", Adapter(rank=4), "pipeline is sd3"),
                                  ("sdxl", Adapter(kind="lokr", rank=4), "this run trained a lokr")):
        net = PipelineDenoiser(str(calls[family][0]))
        adapter.attach(net)
        with pytest.raises(ConfigError, match=f"--format kohya: .*{says}"):
            write_adapter(net.folder, net.model, adapter, {f"model.{k}": v for k, v in net.model.state_dict().items()},
                          str(tmp_path / family), kohya=True)
        assert not (tmp_path / family).exists()
