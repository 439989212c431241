"""``lit-dist sample --config cfg.yaml --checkpoint CKPT --prompt "..."``: images from a generative run's checkpoint.

    lit-dist sample --config runs/t2i/20261125-1200/config.yaml --checkpoint runs/t2i/20261125-1200/checkpoints \\
        --prompt "a red circle on a white background; a blue cross on a yellow background" --num 8 \\
        --guidance 4 --steps 30 --output grid.png

One row per prompt (prompts separated by ";"), ``num`` images each, seeded by ``seed``: the same flags give
the same grid. Prompts are encoded by the run's caption encoder (``data.cache.caption_encoder``), as the
captions it trained on were.
"""

import os

import numpy as np
import torch

from lit_dist.errors import ConfigError, DataError


def sample(cli, checkpoint: str, prompt: str | None = None, num: int = 4, guidance: float = 4.0, steps: int = 30,
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
    from lit_dist.sampling import sample as draw

    model, data = cli.model, cli.datamodule
    objective = getattr(model, "objective", None)
    if not isinstance(objective, Generative):
        raise ConfigError(f"model.objective is {type(objective).__name__}: lit-dist sample needs a generative one "
                          "(lit_dist.objectives.FlowMatching or Diffusion)")
    if num < 1:
        raise ConfigError(f"--num {num}: must be at least 1")
    if objective.input_key != "image":
        raise ConfigError(f"model.input_key = {objective.input_key!r}: lit-dist sample decodes pixels only so far "
                          "(a latent model's images need the VAE's decoder)")
    if not os.path.exists(checkpoint):
        raise DataError(f"checkpoint {checkpoint!r} does not exist")
    prompts = [p.strip() for p in (prompt or "").split(";") if p.strip()]
    condition = _condition(objective, data, prompts, num)
    missing, unexpected = model.net.load_state_dict(network_state(load_checkpoint_state(checkpoint, trust_pickle), ema),
                                                    strict=False)
    if missing or unexpected:
        raise DataError(f"checkpoint {checkpoint} does not fit model.net: {len(missing)} missing keys "
                        f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])})")
    net = model.net.eval()
    rows = max(1, len(prompts))
    size = data.resolution
    images = draw(net, objective, condition, (rows * num, 3, size, size), torch.Generator().manual_seed(seed),
                  steps=steps, guidance=guidance)
    pixels = (images.float().cpu() * data.std + data.mean).clamp(0, 255).round().to(torch.uint8)  # (N, 3, H, W)
    _write_grid(pixels, rows, num, output)
    print(f"lit-dist sample: {rows * num} images ({rows} prompts x {num}, {steps} steps, guidance {guidance}) "
          f"-> {output}")
    return 0


def _condition(objective, data, prompts: list[str], num: int) -> torch.Tensor | None:
    if objective.condition == "none":
        if prompts:
            raise ConfigError("--prompt given, but model.objective.condition is none: the model reads no prompt")
        return None
    if objective.condition == "label":
        raise ConfigError("model.objective.condition is label: lit-dist sample takes captions so far")
    if not prompts:
        raise ConfigError("model.objective.condition is caption: give --prompt \"...\" (several separated by ';')")
    spec = getattr(getattr(data, "cache", None), "caption_encoder", None)
    if spec is None:
        raise ConfigError("data.cache.caption_encoder is not set: lit-dist sample encodes the prompts with the "
                          "run's caption encoder, as its captions were")
    from lit_dist.cache.encoders import load_encoder

    with torch.no_grad():
        embeddings = load_encoder(spec, "caption_encoder")(prompts).float()  # (P, ...)
    return embeddings.repeat_interleave(num, dim=0)


def _write_grid(pixels: torch.Tensor, rows: int, cols: int, path: str) -> None:
    """``pixels`` (rows x cols, 3, H, W) as one PNG, row by row, written whole or not at all (local or S3)."""
    import io

    from PIL import Image

    from lit_dist.ckpt.files import filesystem, is_local, write_atomically

    _, _, h, w = pixels.shape
    grid = pixels.view(rows, cols, 3, h, w).permute(0, 3, 1, 4, 2).reshape(rows * h, cols * w, 3)
    png = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(grid.numpy())).save(png, format="PNG")
    fs, fs_path = filesystem(path if "://" in path else os.path.abspath(path))
    if is_local(fs):  # an object store has no folders to make
        os.makedirs(os.path.dirname(fs_path), exist_ok=True)
    write_atomically(fs, fs_path, lambda f: f.write(png.getvalue()))
