"""``lit-dist sample --config cfg.yaml --checkpoint CKPT --prompt "..."``: images from a generative run's checkpoint.

    lit-dist sample --config runs/t2i/20261125-1200/config.yaml --checkpoint runs/t2i/20261125-1200/checkpoints \\
        --prompt "a red circle on a white background; a blue cross on a yellow background" --num 8 \\
        --guidance 4 --steps 30 --output grid.png

One row per prompt (prompts separated by ";"), ``num`` images each, image ``i`` seeded by (``seed``, ``i``): the
same flags give the same grid, and the same images as the run's own samples (``samples``) of those prompts and
seed. Prompts are encoded by the run's caption encoder (``data.cache.caption_encoder``), as the captions it
trained on were; a label-conditioned model takes class numbers. A model trained on VAE latents is decoded by the
decoder of the VAE that made its cache (``data.cache.encoder``). With a judge (the run's ``samples.judge``, or
``--samples.judge CLASS --samples.judge.classifier ...`` here), the adherence of the images to their prompts is
printed too.
"""

import os
from typing import TYPE_CHECKING

from lit_dist.errors import ConfigError, DataError

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli import RunConfigCLI


def sample(cli: "RunConfigCLI", checkpoint: str, prompt: str | None = None, num: int = 4, guidance: float = 4.0, steps: int = 30,
           seed: int = 0, output: str = "samples.png", ema: bool = False, trust_pickle: bool = False) -> int:
    """Images from a checkpoint of a generative run (model.objective FlowMatching or Diffusion), as a PNG grid.

    Args:
        cli: The run config, given as for fit: --config FILE (the run directory's config.yaml) and dotted overrides.
        checkpoint: A checkpoint file or folder of the run, or its checkpoints folder (the newest usable one).
        prompt: Prompts separated by ";", one row of the grid each; needed when the model is conditioned on captions.
        num: Images per prompt (the grid's columns).
        guidance: Classifier-free guidance scale: 1 is none; 3 to 7 is usual.
        steps: Sampler steps.
        seed: Seed of the initial noise: the same seed gives the same images.
        output: Where the PNG grid is written.
        ema: Sample with the checkpoint's weight average (model.ema) instead of the trained weights.
        trust_pickle: Unpickle whatever types the checkpoint names (only for a file you trust).
    """
    from lit_dist.export import load_checkpoint_state, network_state
    from lit_dist.objectives import Generative
    from lit_dist.sampling import decode, decoder_of, encode_prompts, initial_noise, shape_of, write_grid
    from lit_dist.sampling import sample as draw

    model, data = cli.model, cli.datamodule
    objective = getattr(model, "objective", None)
    if not isinstance(objective, Generative):
        raise ConfigError(f"model.objective is {type(objective).__name__}: lit-dist sample needs a generative one "
                          "(lit_dist.objectives.FlowMatching or Diffusion)")
    if num < 1:
        raise ConfigError(f"--num {num}: must be at least 1")
    if not os.path.exists(checkpoint):
        raise DataError(f"checkpoint {checkpoint!r} does not exist")
    prompts = [p.strip() for p in (prompt or "").split(";") if p.strip()]
    if objective.condition == "none" and prompts:
        raise ConfigError("--prompt given, but model.objective.condition is none: the model reads no prompt")
    if objective.condition != "none" and not prompts:
        raise ConfigError(f"model.objective.condition is {objective.condition}: give --prompt \"...\" (several "
                          "separated by ';'" + (", class numbers or names)" if objective.condition == "label" else ")"))
    _, condition = encode_prompts(objective, data, prompts or [""])
    rows = len(prompts) or 1
    if condition is not None:
        condition = condition.repeat_interleave(num, dim=0)
    decoder = decoder_of(objective, data)
    shape = shape_of(decoder, data.resolution, "data.resolution")
    missing, unexpected = model.net.load_state_dict(network_state(load_checkpoint_state(checkpoint, trust_pickle), ema),
                                                    strict=False)
    if missing or unexpected:
        raise DataError(f"checkpoint {checkpoint} does not fit model.net: {len(missing)} missing keys "
                        f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])})")
    net = model.net.eval()
    images = draw(net, objective, condition, initial_noise(shape, seed, range(rows * num)), steps=steps,
                  guidance=guidance)
    pixels = decode(images, decoder, data.mean, data.std)  # (N, 3, H, W) uint8
    write_grid(pixels, rows, num, output)
    scored = ""
    judge = getattr(cli.config_init.get("samples"), "judge", None)  # samples.judge of the run, or given here
    if judge is not None:
        correct = judge(pixels, [p for p in prompts for _ in range(num)])
        scored = f"; adherence {float(correct.float().mean()):.3f} ({int(correct.sum())} of {len(correct)})"
    print(f"lit-dist sample: {rows * num} images ({rows} prompts x {num}, {steps} steps, guidance {guidance}) "
          f"-> {output}{scored}")
    return 0
