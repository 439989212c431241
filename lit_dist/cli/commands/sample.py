"""``lit-dist sample CKPT --prompt "..."``: images from a generative run's checkpoint.

    lit-dist sample runs/t2i/20261125-1200/checkpoints \\
        --prompt "a red circle on a white background; a blue cross on a yellow background" --num 8 \\
        --guidance 4 --steps 30 --output grid.png

The run config is the config.yaml of the run directory that holds the checkpoint (``--config FILE`` for another:
lit_dist/cli/commands/__init__.py, ``config_of``).

One row per prompt (prompts separated by ";"), ``num`` images each, image ``i`` seeded by (``seed``, ``i``). Left
out, the prompts, ``num``, ``steps``, ``guidance`` and ``seed`` are the run's own samples' (the ``samples`` group
of its config), and so are the weights (its weight average once it has had an update, as the run's own grids
use it, unless ``model.ema.evaluate`` is false), the precision (``trainer.precision``) and the images per denoiser
call (``samples.batch_size``): with the run's config.yaml and one of its checkpoints this draws the grid the run
drew at that step, bitwise on the same kind of device. Prompts are encoded by the run's caption encoder
(``data.cache.caption_encoder``), as the captions it trained on were; a label-conditioned model takes class
numbers. A model trained on VAE latents is decoded by the decoder of the VAE that made its cache
(``data.cache.encoder``). With a judge (the run's ``samples.judge``, or ``--samples.judge CLASS
--samples.judge.classifier ...`` here), the adherence of the images to their prompts is printed too.
"""

import os
from typing import TYPE_CHECKING

from lit_dist.errors import ConfigError, DataError

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli.app import RunConfigCLI


def sample(cli: "RunConfigCLI", checkpoint: str, prompt: str | None = None, num: int | None = None,
           guidance: float | None = None, steps: int | None = None, seed: int | None = None,
           output: str = "samples.png", ema: bool | None = None, device: str = "auto",
           trust_pickle: bool = False, adapter_scale: float | None = None) -> int:
    """Images from a checkpoint of a generative run (model.objective FlowMatching or Diffusion), as a PNG grid.

    Args:
        cli: The run config: the checkpoint's run directory's config.yaml, or --config FILE, and dotted overrides.
        checkpoint: A checkpoint file or folder of the run, or its checkpoints folder (the newest usable one); the
            first argument, or --checkpoint.
        prompt: Prompts separated by ";", one row of the grid each; default: the run's samples.prompts.
        num: Images per prompt (the grid's columns); default: the run's samples.per_prompt.
        guidance: Classifier-free guidance scale (1 is none; 3 to 7 is usual); default: the run's samples.guidance.
        steps: Sampler steps; default: the run's samples.steps.
        seed: Seed of the initial noise: the same seed gives the same images; default: the run's samples.seed.
        output: Where the PNG grid is written.
        ema: Sample with the checkpoint's weight average (true) or the trained weights (false); default: as the
            run's own samples (the average once it has had an update, unless model.ema.evaluate is false).
        device: Where to sample: auto (a GPU when there is one), cpu, cuda or cuda:N.
        trust_pickle: Unpickle whatever types the checkpoint names (only for a file you trust).
        adapter_scale: Strength of the run's model.adapter: its update times this (0: the base alone); default:
            the run's samples.adapter_scale.
    """
    import torch

    from lit_dist.ckpt.export import load_checkpoint_state, network_state
    from lit_dist.model import conditions
    from lit_dist.model.adapters import scaled
    from lit_dist.model.objectives import Generative
    from lit_dist.model.sampling import (
        decode,
        decoder_of,
        encode_prompts,
        initial_noise,
        precision_plugin,
        shape_of,
        write_grid,
    )
    from lit_dist.model.sampling import sample as draw

    model, data = cli.model, cli.datamodule
    run_samples = cli.config_init.get("samples")  # the run's Samples callback: its prompts, seeds and settings
    objective = getattr(model, "objective", None)
    if not isinstance(objective, Generative):
        raise ConfigError(f"model.objective is {type(objective).__name__}: lit-dist sample needs a generative one "
                          "(lit_dist.model.objectives.FlowMatching or Diffusion)")
    num = num if num is not None else getattr(run_samples, "per_prompt", 4)
    steps = steps if steps is not None else getattr(run_samples, "steps", 30)
    guidance = guidance if guidance is not None else getattr(run_samples, "guidance", 4.0)
    seed = seed if seed is not None else getattr(run_samples, "seed", 0)
    adapter_scale = adapter_scale if adapter_scale is not None else getattr(run_samples, "adapter_scale", 1.0)
    if adapter_scale != 1.0 and getattr(model, "adapter", None) is None:
        raise ConfigError(f"--adapter_scale {adapter_scale:g}: the run has no model.adapter to scale")
    if num < 1:
        raise ConfigError(f"--num {num}: must be at least 1")
    target = _device(device)
    if not os.path.exists(checkpoint):
        raise DataError(f"checkpoint {checkpoint!r} does not exist")
    given = [p.strip() for p in (prompt or "").split(";") if p.strip()]
    prompts = given or [str(p) for p in (getattr(run_samples, "prompts", None) or [])]
    if objective.condition == "none" and given:
        raise ConfigError("--prompt given, but model.objective.condition is none: the model reads no prompt")
    if objective.condition == "none":
        prompts = []
    elif not prompts:
        raise ConfigError(f"model.objective.condition is {objective.condition} and the run has no samples.prompts: "
                          "give --prompt \"...\" (several separated by ';'" +
                          (", class numbers or names)" if objective.condition == "label" else ")"))
    _, condition, empty = encode_prompts(objective, data, prompts or [""])
    rows = len(prompts) or 1
    decoder = decoder_of(objective, data)
    shape = shape_of(decoder, getattr(run_samples, "size", None) or data.resolution, "data.resolution")

    state = load_checkpoint_state(checkpoint, trust_pickle)
    averaged = _use_average(ema, model, state)
    if getattr(model, "adapter", None) is not None:  # its checkpoint holds the adapter; the base is the folder's
        model.check_base(state.get("adapter_base"), checkpoint)
    missing, unexpected = model.net.load_state_dict(network_state(state, averaged), strict=False)
    base = {name.removeprefix("net.") for name in getattr(model, "base_state", ())}
    missing = [name for name in missing if name not in base]
    if missing or unexpected:
        raise DataError(f"checkpoint {checkpoint} does not fit model.net: {len(missing)} missing keys "
                        f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])})")
    plugin = precision_plugin(cli.config.trainer.precision, cli.config.trainer.strategy, target)
    net = plugin.convert_module(model.net).eval().to(target)
    if decoder is not None:
        decoder.to(target)
    total = rows * num
    per_call = getattr(run_samples, "batch_size", None) or total  # the run's groups: the same arithmetic
    images = []
    with torch.no_grad(), scaled(net, adapter_scale):
        for start in range(0, total, per_call):
            indices = range(start, min(start + per_call, total))
            group = conditions.take(condition, torch.tensor([i // num for i in indices]))
            with plugin.forward_context():
                drawn = draw(net, objective, group, initial_noise(shape, seed, indices), steps=steps, guidance=guidance,
                             empty=empty)
            images.append(decode(drawn, decoder, data.mean, data.std))  # (n, 3, H, W) uint8 on the CPU
    pixels = torch.cat(images)
    write_grid(pixels, rows, num, output)
    scored = ""
    judge = getattr(run_samples, "judge", None)  # samples.judge of the run, or given here
    if judge is not None:
        correct = judge(pixels, [p for p in prompts for _ in range(num)])
        scored = f"; adherence {float(correct.float().mean()):.3f} ({int(correct.sum())} of {len(correct)})"
    weights = f"the weight average ({int(state['ema.updates'])} updates)" if averaged and "ema.updates" in state \
        else "the weight average" if averaged else "the trained weights"
    if getattr(model, "adapter", None) is not None:
        weights += f" and the adapter at scale {adapter_scale:g}"
    prompts_word = "prompt" if rows == 1 else "prompts"
    print(f"lit-dist sample: {total} images ({rows} {prompts_word} x {num}, {steps} steps, guidance {guidance}, "
          f"seed {seed}) with {weights} on {target} -> {output}{scored}")
    return 0


def _use_average(asked: bool | None, model, state: dict) -> bool:
    """Whether to sample with the checkpoint's weight average: as asked, else as the run's own samples would."""
    if asked is not None:
        return asked  # network_state refuses an average that is not there, or has had no update
    ema = getattr(model, "ema", None)
    if ema is None or not ema.evaluate or not any(k.startswith("ema.average.") for k in state):
        return False
    updates = state.get("ema.updates")
    return updates is None or int(updates) > 0


def _device(name: str):
    """The torch device ``--device`` names (auto: the first GPU when there is one)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device {name!r}: not a device ({exc}); use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this machine has no CUDA GPU; use --device cpu")
    return device
