"""lit_dist.model.sampling against denoisers that know the answer: when all the data is one image x*, the ideal flow
matching velocity is (x_t - x*) / t and the ideal noise prediction is (x_t - sqrt(a) x*) / sqrt(1 - a); diffusers'
samplers driven by lit-dist's objectives must then land on x* from any noise, which checks the time and timestep
conventions end to end. Guidance and the same seeds giving the same images are checked too."""

import pytest
import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.model.objectives import Diffusion, FlowMatching
from lit_dist.model.sampling import initial_noise, null_condition, sample

pytestmark = pytest.mark.unit
TARGET = torch.linspace(-1, 1, 2 * 3 * 4 * 4).view(2, 3, 4, 4)


class FlowOracle(nn.Module):
    def __init__(self):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # sample() reads the device and dtype from a parameter
        self.seen = []

    def forward(self, x, timestep, condition):
        self.seen.append(condition)
        t = (timestep / 1000).view(-1, 1, 1, 1)
        return (x - TARGET.repeat(len(x) // len(TARGET), 1, 1, 1)) / t  # guided batches hold x twice


class EpsilonOracle(nn.Module):
    def __init__(self, objective):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))
        self.alphas = objective.scheduler.alphas_cumprod

    def forward(self, x, timestep, condition):
        a = self.alphas[timestep.long()].view(-1, 1, 1, 1)
        return (x - a.sqrt() * TARGET) / (1 - a).sqrt()


def bound(objective):
    objective.bind("image", "label")
    return objective


def test_flow_matching_euler_lands_on_the_one_image_the_ideal_velocity_points_to():
    out = sample(FlowOracle(), bound(FlowMatching(condition="none")), None, initial_noise((3, 4, 4), 0, range(2)),
                 steps=10)
    torch.testing.assert_close(out, TARGET, atol=1e-4, rtol=0)


def test_ddim_on_the_training_schedule_lands_on_the_one_image_the_ideal_noise_points_to():
    objective = bound(Diffusion(prediction="epsilon", condition="none"))
    out = sample(EpsilonOracle(objective), objective, None, initial_noise((3, 4, 4), 0, range(2)), steps=20)
    torch.testing.assert_close(out, TARGET, atol=1e-3, rtol=0)


def test_the_same_seed_gives_the_same_images_and_another_seed_others():
    from lit_dist.model.nets import TinyUNet

    torch.manual_seed(0)
    net = TinyUNet(channels=(8, 16), num_classes=3, embed_dim=16).eval()
    objective = bound(FlowMatching(condition="label", null_label=3))
    labels = torch.tensor([0, 2])
    state = torch.get_rng_state()
    a = sample(net, objective, labels, initial_noise((3, 8, 8), 7, range(2)), steps=4, guidance=3.0)
    b = sample(net, objective, labels, initial_noise((3, 8, 8), 7, range(2)), steps=4, guidance=3.0)
    c = sample(net, objective, labels, initial_noise((3, 8, 8), 8, range(2)), steps=4, guidance=3.0)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)  # training's random state is left alone


def test_guidance_asks_for_the_condition_and_the_objectives_no_condition_in_one_batch():
    net = FlowOracle()
    captions = torch.randn(2, 5, 16)
    sample(net, bound(FlowMatching()), captions, initial_noise((3, 4, 4), 0, range(2)), steps=2, guidance=4.0)
    seen = net.seen[0]
    assert seen.shape == (4, 5, 16) and torch.equal(seen[:2], captions) and not seen[2:].any()
    labels = bound(FlowMatching(condition="label", null_label=9))
    assert null_condition(labels, torch.tensor([1, 2])).tolist() == [9, 9]
    with pytest.raises(ConfigError, match="needs model.objective.null_label"):
        null_condition(bound(FlowMatching(condition="label", condition_dropout=0.0)), torch.tensor([1]))


def test_guidance_moves_the_prediction_away_from_the_unconditional_one_by_its_scale():
    class Constant(nn.Module):  # predicts 1 given a caption, 0 given none
        def __init__(self):
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(()))

        def forward(self, x, timestep, condition):
            return condition.flatten(1).any(1).float().view(-1, 1, 1, 1).expand_as(x).clone()

    objective, captions = bound(FlowMatching()), torch.ones(2, 5, 16)
    noise = initial_noise((3, 4, 4), 0, range(2))
    # One Euler step from sigma 1 to 0: x0 = noise - prediction, the prediction being 0 + 4 x (1 - 0).
    out = sample(Constant(), objective, captions, noise, steps=1, guidance=4.0)
    torch.testing.assert_close(out, noise - 4.0)


def test_an_images_noise_is_its_own_whichever_images_share_its_batch():
    both = initial_noise((3, 4, 4), 5, [0, 1])
    assert torch.equal(initial_noise((3, 4, 4), 5, [1]), both[1:])
    assert not torch.equal(both[0], both[1]) and not torch.equal(initial_noise((3, 4, 4), 6, [1]), both[1:])


@pytest.mark.parametrize("objective", [FlowMatching(condition="caption"), Diffusion(condition="caption")])
def test_a_diffusers_unet_in_bf16_samples_from_float32_caption_embeddings(objective):
    # bf16-true (and DeepSpeed's bf16) run without autocast, and diffusers' UNet2DConditionModel does not cast the
    # condition itself: the sampler casts it to the weights' dtype, as it does the noise.
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    net = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                         block_out_channels=(32, 32), norm_num_groups=8, cross_attention_dim=16,
                                         attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")).to(torch.bfloat16).eval()
    condition = torch.randn(2, 5, 16)  # (B, tokens, width) float32, as the caption cache holds them
    images = sample(net, objective, condition, initial_noise((4, 8, 8), 0, range(2)), steps=2, guidance=3.0)
    assert images.shape == (2, 4, 8, 8) and images.dtype == torch.bfloat16 and images.isfinite().all()
