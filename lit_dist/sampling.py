"""Images from a denoiser trained by a generative objective (lit_dist.objectives), with diffusers' samplers:
flow-match Euler for ``FlowMatching``, DDIM on the training schedule for ``Diffusion``; classifier-free
guidance against the objective's own "no condition" (an all-zero caption embedding, or ``null_label``).
The noise comes from the caller's generator, so that the same seeds give the same images after a resume
and at any world size, and training's random state is never touched."""

import torch
from torch import nn

from lit_dist.errors import ConfigError
from lit_dist.objectives import Diffusion, FlowMatching, Generative, denoise


def null_condition(objective: Generative, condition: torch.Tensor | None) -> torch.Tensor | None:
    """What the objective trained as "no condition", shaped like ``condition``."""
    if condition is None:
        return None
    if objective.condition == "label":
        if objective.null_label is None:
            raise ConfigError("guidance with labels needs model.objective.null_label (and a model trained with "
                              "condition_dropout > 0)")
        return torch.full_like(condition, objective.null_label)
    return torch.zeros_like(condition)


def scheduler_for(objective: Generative, steps: int):
    """A diffusers scheduler set to ``steps`` steps, matching how ``objective`` trained."""
    if steps < 1:
        raise ConfigError(f"sampling steps = {steps}: must be at least 1")
    if isinstance(objective, FlowMatching):
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    elif isinstance(objective, Diffusion):
        from diffusers import DDIMScheduler

        scheduler = DDIMScheduler.from_config(objective.scheduler.config, clip_sample=False, set_alpha_to_one=True,
                                              timestep_spacing="trailing")
    else:
        raise ConfigError(f"{type(objective).__name__} is not a generative objective: nothing to sample")
    scheduler.set_timesteps(steps)
    return scheduler


@torch.no_grad()
def sample(net: nn.Module, objective: Generative, condition: torch.Tensor | None, shape: tuple[int, ...],
           generator: torch.Generator, steps: int = 30, guidance: float = 1.0) -> torch.Tensor:
    """``shape[0]`` samples of ``shape`` (B, C, H, W), in the space the model trained in (pixels as normalised,
    or latents), from noise drawn with ``generator`` (on the CPU, so the same seed gives the same images on
    any device). ``guidance`` > 1 mixes conditional and unconditional predictions."""
    device = next(net.parameters()).device
    dtype = next(net.parameters()).dtype
    scheduler = scheduler_for(objective, steps)
    x = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    if isinstance(objective, Diffusion):
        x = x * scheduler.init_noise_sigma
    guided = guidance != 1.0 and condition is not None
    null = null_condition(objective, condition) if guided else None
    for t in scheduler.timesteps:
        timestep = t.to(device=device, dtype=torch.float32).expand(shape[0])
        if guided:
            both = denoise(net, torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([condition, null]))
            cond_out, null_out = both.chunk(2)
            out = null_out + guidance * (cond_out - null_out)
        else:
            out = denoise(net, x, timestep, condition)
        x = scheduler.step(out, t, x).prev_sample
    return x
