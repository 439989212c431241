"""The objectives of lit_dist.model.objectives, checked against their definitions and diffusers' own schedule: what a
denoiser is given, what it is asked to predict, how timesteps are drawn and weighted, condition dropout, and a
validation loss that does not depend on how samples fall into batches."""

import pytest
import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.model.module import LitModel
from lit_dist.model.nets import TinyUNet
from lit_dist.model.objectives import Classification, Diffusion, FlowMatching

pytestmark = pytest.mark.unit


class Recorder(nn.Module):
    """A denoiser that records what it was given and predicts ``prediction`` (zeros by default)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.prediction = None

    def forward(self, x, timestep, condition):
        self.calls.append((x.clone(), timestep.clone(), condition))
        return torch.zeros_like(x) if self.prediction is None else self.prediction


def batch(n=4, label=False, rows=None):
    g = torch.Generator().manual_seed(1)
    out = {"image": torch.randn(n, 3, 8, 12, generator=g), "caption_embedding": torch.randn(n, 5, 16, generator=g),
           "label": torch.arange(n) % 3}
    if rows is not None:
        out["row"] = torch.tensor(rows)
    return out


def train(model: LitModel, b: dict, steps: int, lr: float = 3e-3) -> None:
    """``steps`` AdamW steps of ``model``'s loss on the one batch ``b``."""
    optimizer = torch.optim.AdamW(model.net.parameters(), lr=lr)
    for _ in range(steps):
        loss = model.compute_loss(b)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def bound(objective):
    objective.bind("image", "label")
    return objective


def test_flow_matching_interpolates_to_the_noise_and_asks_for_the_velocity():
    objective, net = bound(FlowMatching(condition_dropout=0.0)), Recorder()
    x0 = batch()["image"]
    noise, t = torch.randn_like(x0), torch.tensor([0.1, 0.4, 0.7, 0.95])
    net.prediction = noise - x0
    assert torch.allclose(objective.per_sample_loss(net, x0, noise, t, None), torch.zeros(4), atol=1e-12)
    x_t, timestep, _ = net.calls[0]
    tt = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - tt) * x0 + tt * noise)
    torch.testing.assert_close(timestep, t * 1000)  # diffusers' scale
    net.prediction = None  # predicting zeros costs the velocity's mean square
    expected = ((noise - x0) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(objective.per_sample_loss(net, x0, noise, t, None), expected)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_diffusion_noises_and_targets_as_diffusers_ddpm_schedule_does(prediction):
    from diffusers import DDPMScheduler

    objective, net = bound(Diffusion(prediction=prediction, condition="none")), Recorder()
    reference = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", prediction_type=prediction)
    x0 = batch()["image"]
    noise, t = torch.randn_like(x0), torch.tensor([0.0, 0.25, 0.5, 0.999])
    steps = torch.tensor([0, 250, 500, 999])
    target = noise if prediction == "epsilon" else reference.get_velocity(x0, noise, steps)
    net.prediction = target
    assert torch.allclose(objective.per_sample_loss(net, x0, noise, t, None), torch.zeros(4), atol=1e-10)
    x_t, timestep, _ = net.calls[0]
    torch.testing.assert_close(x_t, reference.add_noise(x0, noise, steps))
    assert timestep.tolist() == [0.0, 250.0, 500.0, 999.0]


def test_a_zero_terminal_snr_schedule_noises_as_diffusers_does_and_its_last_step_is_pure_noise():
    from diffusers import DDPMScheduler

    net = Recorder()
    reference = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                              prediction_type="v_prediction", rescale_betas_zero_snr=True)
    objective = bound(Diffusion(prediction="v_prediction", condition="none", rescale_betas_zero_snr=True,
                                beta_start=0.00085, beta_end=0.012, snr_gamma=5.0))
    x0 = batch()["image"]
    noise, t = torch.randn_like(x0), torch.tensor([0.0, 0.25, 0.5, 0.9995])
    steps = torch.tensor([0, 250, 500, 999])
    net.prediction = reference.get_velocity(x0, noise, steps)
    losses = objective.per_sample_loss(net, x0, noise, t, None)
    assert torch.isfinite(losses).all() and torch.allclose(losses, torch.zeros(4), atol=1e-10)
    x_t = net.calls[0][0]
    torch.testing.assert_close(x_t, reference.add_noise(x0, noise, steps))
    torch.testing.assert_close(x_t[3], noise[3])  # the last step holds nothing of the image
    with pytest.raises(ConfigError, match="rescale_betas_zero_snr = true needs prediction: v_prediction"):
        Diffusion(rescale_betas_zero_snr=True)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_gamma_weighs_each_timestep_by_min_snr_gamma_over_its_snr(prediction):
    from diffusers import DDPMScheduler

    gamma = 5.0
    weighted = bound(Diffusion(prediction=prediction, snr_gamma=gamma, condition="none"))
    plain = bound(Diffusion(prediction=prediction, condition="none"))
    x0 = batch()["image"]
    noise, t = torch.randn_like(x0), torch.tensor([0.01, 0.2, 0.6, 0.99])
    ratio = weighted.per_sample_loss(Recorder(), x0, noise, t, None) / plain.per_sample_loss(Recorder(), x0, noise, t, None)
    alphas = DDPMScheduler(beta_schedule="scaled_linear").alphas_cumprod[(t * 1000).long()]
    snr = alphas / (1 - alphas)
    expected = snr.clamp(max=gamma) / (snr if prediction == "epsilon" else snr + 1)
    torch.testing.assert_close(ratio, expected)
    assert ratio[0] < 0.1  # a nearly clean sample (SNR far above gamma) weighs little
    if prediction == "epsilon":  # below gamma an epsilon loss keeps its full weight
        assert ratio[-1] == pytest.approx(1.0)


def test_timesteps_are_uniform_or_logit_normal_with_its_mean_and_std():
    g = torch.Generator().manual_seed(0)
    uniform = bound(FlowMatching(timesteps="uniform")).sample_t(20_000, "cpu", g)
    assert 0 < uniform.min() and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01
    t = bound(FlowMatching(timesteps="logit_normal", logit_mean=0.5, logit_std=0.8)).sample_t(20_000, "cpu", g)
    logit = torch.log(t / (1 - t))
    assert abs(logit.mean() - 0.5) < 0.03 and abs(logit.std() - 0.8) < 0.03


def test_condition_dropout_drops_captions_to_zeros_and_labels_to_the_null_label_in_training_only():
    torch.manual_seed(0)
    b = batch(n=4000)
    b["caption_embedding"] = torch.ones(4000, 5, 16)
    captions = bound(FlowMatching(condition_dropout=0.25)).condition_of(b, train=True)
    dropped = (captions == 0).all(dim=(1, 2))
    assert ((captions == 1).all(dim=(1, 2)) | dropped).all() and abs(dropped.float().mean() - 0.25) < 0.03
    labels = bound(FlowMatching(condition="label", condition_dropout=0.25, null_label=3)).condition_of(b, train=True)
    assert abs((labels == 3).float().mean() - 0.25) < 0.03 and (labels[labels != 3] == b["label"][labels != 3]).all()
    assert bound(FlowMatching(condition_dropout=0.25)).condition_of(b, train=False) is b["caption_embedding"]


def test_the_validation_loss_is_the_same_whatever_batches_the_samples_fall_in():
    objective = bound(FlowMatching(condition="none", eval_timesteps=4))
    net = TinyUNet(in_channels=3, channels=(8, 16), embed_dim=16).eval()
    whole = batch(n=4, rows=[10, 11, 12, 13])
    with torch.no_grad():
        together = objective.loss(net, whole, train=False)[0]
        apart = [objective.loss(net, {k: v[i:i + 2] for k, v in whole.items()}, train=False)[0] for i in (0, 2)]
        again = objective.loss(net, whole, train=False)[0]
    assert together == again  # fixed timesteps and noises: comparable across validations and resumes
    torch.testing.assert_close(together, sum(apart) / 2)


def test_a_denoiser_that_returns_another_shape_is_a_config_error():
    objective = bound(FlowMatching(condition="none"))

    class Wrong(nn.Module):
        def forward(self, x, timestep, condition):
            return x.mean(1)

    with pytest.raises(ConfigError, match=r"returned Tensor \(4, 8, 12\) for a noisy input of \(4, 3, 8, 12\)"):
        objective.loss(Wrong(), batch(), train=True)


def test_bad_objective_settings_are_config_errors_naming_each_field():
    with pytest.raises(ConfigError) as caught:
        FlowMatching(condition="text", condition_dropout=1.0, timesteps="cosine", logit_std=0)
    for field in ("condition = 'text'", "condition_dropout = 1.0", "timesteps = 'cosine'", "logit_std = 0"):
        assert field in str(caught.value)
    with pytest.raises(ConfigError, match="needs model.objective.null_label"):
        FlowMatching(condition="label", condition_dropout=0.1)
    with pytest.raises(ConfigError, match="snr_gamma = 0"):
        Diffusion(snr_gamma=0)
    with pytest.raises(ConfigError, match="with model.objective set, give it as model.objective.init_args.loss"):
        LitModel(net=nn.Linear(2, 2), loss=nn.MSELoss(), objective=FlowMatching())
    objective = bound(FlowMatching(condition_key="t5"))
    with pytest.raises(ConfigError, match=r"reads the batch key 't5', and the batches hold \['caption_embedding'"):
        objective.loss(Recorder(), batch(), train=True)


@pytest.mark.parametrize("condition", ["caption", "label"])
def test_the_tiny_unet_learns_what_each_condition_asks_for(condition):
    """Three labels (or captions) each name one flat colour; after training, the loss given the right condition is
    well below the loss given another sample's: the denoiser reads its condition."""
    torch.manual_seed(0)
    colours = torch.tensor([[1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])
    labels = torch.arange(12) % 3
    captions = torch.randn(3, 4, 16)[labels]  # (12, 4 tokens, 16)
    b = {"image": colours[labels][:, :, None, None].expand(12, 3, 8, 8).contiguous(), "label": labels,
         "caption_embedding": captions, "row": torch.arange(12)}
    objective = bound(FlowMatching(condition=condition, condition_dropout=0.0, timesteps="uniform"))
    net = TinyUNet(channels=(16, 32), context_dim=16 if condition == "caption" else None,
                   num_classes=3 if condition == "label" else None, embed_dim=32)
    model = LitModel(net=net, objective=objective)
    train(model, b, steps=80)
    model.eval()
    shifted = {**b, "label": b["label"].roll(1), "caption_embedding": b["caption_embedding"].roll(1, dims=0)}
    with torch.no_grad():
        right, wrong = model.compute_loss(b)[0], model.compute_loss(shifted)[0]
    assert right < 0.5 * wrong, (right, wrong)


def test_the_tiny_unet_tells_captions_of_the_same_tokens_in_another_order_apart():
    """"a blue circle on a red background" and "a red circle on a blue background" hold the same tokens: two
    captions, one the other reversed, name two colours. Attention without token positions (and a mean pool) sees
    one set of tokens and cannot learn it; TinyUNet's learned positions can."""
    torch.manual_seed(0)
    colours = torch.tensor([[1.0, -1.0, -1.0], [-1.0, -1.0, 1.0]])
    tokens = torch.randn(4, 16)
    captions = torch.stack([tokens, tokens.flip(0)])  # (2 captions, 4 tokens, 16): one set of tokens
    labels = torch.arange(12) % 2
    b = {"image": colours[labels][:, :, None, None].expand(12, 3, 8, 8).contiguous(), "label": labels,
         "caption_embedding": captions[labels], "row": torch.arange(12)}
    objective = bound(FlowMatching(condition="caption", condition_dropout=0.0, timesteps="uniform"))
    model = LitModel(net=TinyUNet(channels=(16, 32), context_dim=16, embed_dim=32), objective=objective)
    train(model, b, steps=80)
    model.eval()
    with torch.no_grad():
        right = model.compute_loss(b)[0]
        wrong = model.compute_loss({**b, "caption_embedding": captions[1 - labels]})[0]
    assert right < 0.5 * wrong, (right, wrong)

    with pytest.raises(ConfigError, match=r"TinyUNet got 300 caption tokens, more than its max_tokens \(256\)"):
        model.net(b["image"][:1], torch.zeros(1), torch.zeros(1, 300, 16))


def test_diffusers_unet_works_through_the_denoiser_signature():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                block_out_channels=(32, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=8, norm_num_groups=8)
    objective = bound(Diffusion(prediction="v_prediction", condition_dropout=0.5))
    loss, _ = objective.loss(unet, {k: v if k != "image" else v[..., :8] for k, v in batch().items()}, train=True)
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in unet.parameters() if p.requires_grad)


def test_classification_stays_the_default_with_its_loss_and_accuracy():
    model = LitModel(net=nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 12, 3)))
    assert isinstance(model.objective, Classification)
    loss, metrics = model.compute_loss(batch())
    assert loss.item() > 0 and set(metrics) == {"acc"}
    assert set(model.predict_step(batch(), 0)) == {"prediction", "probability"}


def test_a_classification_loss_with_buffers_stays_a_submodule_of_the_model():
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    model = LitModel(net=nn.Linear(4, 3), loss=weighted)
    assert model.loss is weighted and "loss.weight" in model.state_dict()  # moves with .to(device), as before
    assert "loss.weight" in LitModel(net=nn.Linear(4, 3), objective=Classification(weighted)).state_dict()


def test_a_diffusers_transformer_denoiser_trains_and_samples_through_the_signature():
    """diffusers' DiT (a class-conditional transformer: forward(hidden_states, timestep, class_labels)) as model.net:
    the loss falls on a fixed batch and the sampler draws from it with guidance against the null label."""
    from diffusers import DiTTransformer2DModel

    from lit_dist.model.sampling import initial_noise, sample

    torch.manual_seed(0)
    # num_embeds_ada_norm: its label table (num classes + 1 null); out_channels: no learned sigma, x_t's shape.
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=3, out_channels=3,
                                num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=3, norm_num_groups=8)
    objective = bound(FlowMatching(condition="label", null_label=3, condition_dropout=0.0, timesteps="uniform"))
    b = {**batch(), "image": batch()["image"][..., :8], "label": torch.tensor([0, 1, 2, 1])}
    model = LitModel(net=dit, objective=objective)
    model.eval()
    with torch.no_grad():
        before = model.compute_loss(b)[0]
    model.train()
    train(model, b, steps=40)
    model.eval()
    with torch.no_grad():
        after = model.compute_loss(b)[0]
    assert after < 0.9 * before, (before, after)  # 2.45 -> 2.0: flow matching on noise has a high floor
    images = sample(dit, objective, torch.tensor([0, 2]), initial_noise((3, 8, 8), 0, range(2)), steps=3, guidance=2.0)
    assert images.shape == (2, 3, 8, 8) and torch.isfinite(images).all()


def test_a_network_that_is_no_denoiser_is_a_config_error_before_training():
    with pytest.raises(ConfigError, match=r"model.net \(Linear\) is called as net\(x_t, timestep, condition\)"):
        LitModel(net=nn.Linear(2, 2), objective=FlowMatching())


def test_a_batch_without_the_models_keys_is_one_config_error_naming_what_it_holds():
    latent = FlowMatching(condition="none")
    latent.bind("latent", "label")
    with pytest.raises(ConfigError, match=r"model.input_key = 'latent', and the batches hold \['caption_embedding', "):
        latent.loss(Recorder(), batch(), train=True)
    objective = Classification()
    objective.bind("image", "target")
    with pytest.raises(ConfigError, match=r"model.target_key = 'target'"):
        objective.loss(nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 12, 3)), batch(), train=True)


def test_evaluation_noises_differ_within_a_batch_without_rows():
    # Batches of a data module other than lit-dist's have no "row": every sample of one drew the same noise.
    objective = FlowMatching(condition="none")
    seen = []

    def net(x_t, timestep, condition):
        seen.append(x_t.clone())
        return torch.zeros_like(x_t)

    objective.bind("image", "label")
    objective.fixed_losses(net, torch.zeros(3, 2, 4, 4), None, rows=None)
    noises = seen[0]  # at t = 1 / (2 x eval_timesteps) with x0 = 0: x_t is the noise times t
    assert not torch.equal(noises[0], noises[1]) and not torch.equal(noises[1], noises[2])


@pytest.mark.parametrize("kind", ["diffusion", "flow"])
def test_noise_offset_and_input_perturbation_follow_diffusers_train_text_to_image(kind):
    from diffusers import DDPMScheduler

    make = Diffusion if kind == "diffusion" else FlowMatching
    objective, net = bound(make(condition="none", noise_offset=0.1, input_perturbation=0.1)), Recorder()
    x0 = batch()["image"]
    torch.manual_seed(3)
    noise, noised_with = objective.training_noise(x0)
    torch.manual_seed(3)  # the script's own lines, in its order of draws
    reference = torch.randn_like(x0)
    reference += 0.1 * torch.randn((x0.shape[0], x0.shape[1], 1, 1), device=x0.device)
    new_noise = reference + 0.1 * torch.randn_like(reference)
    assert torch.equal(noise, reference) and torch.equal(noised_with, new_noise)
    # The input is noised with the perturbed noise; the target is still made of the noise.
    t = torch.tensor([0.1, 0.4, 0.7, 0.95])
    if kind == "diffusion":
        steps = (t * 1000).long()
        net.prediction = noise
        expected_input = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear").add_noise(
            x0, new_noise, steps)
    else:
        net.prediction = noise - x0
        expected_input = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * new_noise
    assert torch.allclose(objective.per_sample_loss(net, x0, noise, t, None, noised_with), torch.zeros(4), atol=1e-10)
    torch.testing.assert_close(net.calls[0][0], expected_input)


def test_the_noise_knobs_off_draw_what_a_run_without_them_draws():
    x0 = batch()["image"]
    plain = bound(Diffusion(condition="none"))
    torch.manual_seed(5)
    noise, noised_with = plain.training_noise(x0)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(noise, torch.randn_like(x0)) and noised_with is None
    assert torch.equal(after, torch.rand(3)), "an extra draw would change every later step of a run"


def test_the_noise_offset_comes_in_its_share_of_batches_and_is_one_value_per_sample_and_channel():
    objective = bound(FlowMatching(condition="none", noise_offset=0.5, noise_offset_probability=0.25))
    x0 = torch.zeros(2, 3, 16, 16)
    offsets = 0
    torch.manual_seed(0)
    for _ in range(400):
        noise, _ = objective.training_noise(x0)
        means = noise.mean((2, 3))  # the offset moves a whole channel; a plain normal's channel mean is ~0 +- 0.06
        offsets += bool((means.abs() > 0.2).any())
    assert 0.15 < offsets / 400 < 0.35, offsets
    for bad, field in ((dict(noise_offset=-1), "noise_offset"), (dict(noise_offset_probability=2), "probability"),
                       (dict(input_perturbation=-0.1), "input_perturbation")):
        with pytest.raises(ConfigError, match=field):
            FlowMatching(**bad)


def test_the_validation_loss_comes_with_its_value_in_bands_of_time():
    objective, net = bound(FlowMatching(condition="none", eval_timesteps=8)), Recorder()
    b = batch(rows=[3, 1, 4, 1])
    loss, bands = objective.loss(net, b, train=False)
    per_time = objective.losses_by_time(net, b["image"], None, b["row"])  # times 1/16, 3/16, ..., 15/16
    assert list(bands) == ["loss_t000-250", "loss_t250-500", "loss_t500-750", "loss_t750-1000"]
    for k, name in enumerate(bands):
        torch.testing.assert_close(bands[name], ((per_time[2 * k] + per_time[2 * k + 1]) / 2).mean())
    # A denoiser right below timestep 500 (it knows x0, so the noise in x_t) and predicting zeros above: the low
    # bands cost nothing, the high ones the velocity's square.
    x0 = b["image"]

    class RightAtLowNoise(nn.Module):
        def forward(self, x, timestep, condition):
            s = (timestep / 1000).view(-1, 1, 1, 1)
            right = (x - (1 - s) * x0) / s - x0
            return torch.where(s < 0.5, right, torch.zeros_like(x))

    _, bands = objective.loss(RightAtLowNoise(), b, train=False)
    assert bands["loss_t000-250"] < 1e-8 and bands["loss_t250-500"] < 1e-8 and bands["loss_t750-1000"] > 0.5, bands
    torch.testing.assert_close(loss, torch.stack([*objective.loss(Recorder(), b, train=False)[1].values()]).mean())
    assert objective.loss(Recorder(), b, train=True)[1] == {}, "training logs no bands"
    assert bound(Diffusion(condition="none", eval_bands=0)).loss(Recorder(), b, train=False)[1] == {}
    odd = bound(Diffusion(condition="none", eval_timesteps=6, eval_bands=3)).loss(Recorder(), b, train=False)[1]
    assert list(odd) == ["loss_t000-333", "loss_t333-666", "loss_t666-1000"]
    with pytest.raises(ConfigError, match="eval_bands = 9: must be 0 .none. or 2 to eval_timesteps .8."):
        FlowMatching(eval_bands=9)
