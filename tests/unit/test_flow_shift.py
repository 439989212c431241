"""Flow matching's timestep shift, in training and sampling, against diffusers' FlowMatchEulerDiscreteScheduler: SD3's
constant shift and Flux's shift by the image's token count give the noise levels the scheduler gives, and the
sampler's steps are FluxPipeline's."""

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from lit_dist.errors import ConfigError  # noqa: E402
from lit_dist.model.objectives import FlowMatching  # noqa: E402
from lit_dist.model.sampling import scheduler_for  # noqa: E402


def test_a_constant_shift_gives_the_scheduler_s_training_sigmas():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    t = torch.arange(1000, 0, -1, dtype=torch.float32) / 1000  # the unshifted sigmas the scheduler starts from
    ours = FlowMatching(shift=3.0).noise_level(t, torch.zeros(1, 4, 8, 8))
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)
    assert (ours[1:] > t[1:]).all(), "shifted towards noise (1 stays 1)"
    assert torch.equal(FlowMatching().noise_level(t, torch.zeros(1, 4, 8, 8)), t), "shift 1: the times as drawn"


def test_a_dynamic_shift_follows_the_token_count_as_flux_s_pipeline_computes_it():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    objective = FlowMatching(dynamic_shift=True)
    t = torch.linspace(0.01, 0.99, 50)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    small, large = torch.zeros(1, 16, 32, 32), torch.zeros(1, 16, 128, 128)  # 256 and 4096 tokens of 2 x 2
    for latents in (small, large):
        mu = calculate_shift((latents.shape[-2] // 2) * (latents.shape[-1] // 2))
        assert objective.mu(*latents.shape[-2:]) == pytest.approx(mu)
        torch.testing.assert_close(objective.noise_level(t, latents), scheduler.time_shift(mu, 1.0, t))
    assert (objective.noise_level(t, large) > objective.noise_level(t, small)).all(), "larger images: noisier"


def test_the_sampler_takes_flux_s_steps_for_the_image_s_size():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    objective = FlowMatching(dynamic_shift=True)
    ours = scheduler_for(objective, 12, (16, 64, 48))
    theirs = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096)
    retrieve_timesteps(theirs, 12, "cpu", sigmas=np.linspace(1.0, 1 / 12, 12), mu=calculate_shift(32 * 24))
    torch.testing.assert_close(ours.timesteps, theirs.timesteps)
    torch.testing.assert_close(ours.sigmas, theirs.sigmas)
    sd3 = scheduler_for(FlowMatching(shift=3.0), 12)
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(12)
    torch.testing.assert_close(sd3.timesteps, reference.timesteps)


def test_shift_settings_that_cannot_work_are_one_line_each():
    with pytest.raises(ConfigError, match="shift = 0.0: must be positive"):
        FlowMatching(shift=0.0)
    with pytest.raises(ConfigError, match="shift = 3.0 with dynamic_shift: true"):
        FlowMatching(shift=3.0, dynamic_shift=True)
    with pytest.raises(ConfigError, match="max_image_seq_len = 256: must be above base_image_seq_len"):
        FlowMatching(dynamic_shift=True, max_image_seq_len=256)
