"""The model card (``README.md``) of an exported pipeline folder: what it was fine-tuned from, how, and what it drew.

Written by ``lit-dist export --format diffusers`` from what the run left beside the checkpoint (its ``config.yaml``,
the checkpoint's ``COMPLETE.json``: step, world size), and by the ``export`` callback at the end of a run (the
trainer's step and world size); in both, the last sample grid at or before that step with its prompts
(``samples/step-N.png`` and ``.txt``) is copied into the folder as ``samples.png``.
"""

import re
import shutil
from pathlib import Path


def run_dir_of(checkpoint: str) -> Path | None:
    """The run directory of a checkpoint (``<run>/checkpoints[/step-N[/state.ckpt]]``): the nearest folder above it
    holding a ``config.yaml``; None for a checkpoint outside a run directory."""
    here = Path(checkpoint).absolute()
    for folder in [here, *here.parents][:4]:
        if (folder / "config.yaml").is_file():
            return folder
    return None


def checkpoint_facts(checkpoint: str) -> dict:
    """What a lit-dist checkpoint's COMPLETE.json says (step, epoch, world_size, strategy); {} for other files."""
    import json

    here = Path(checkpoint).absolute()
    for candidate in (here / "COMPLETE.json", here.parent / "COMPLETE.json"):
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except (OSError, ValueError):
                return {}
    steps = sorted(here.glob("step-*/COMPLETE.json")) if here.is_dir() else []
    return checkpoint_facts(str(steps[-1].parent)) if steps else {}


def run_config(run: Path | None) -> dict:
    """A run directory's saved ``config.yaml`` as a dict; {} without a run directory."""
    import yaml

    from lit_dist.errors import DataError

    if run is None:
        return {}
    path = run / "config.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise DataError(f"{path} cannot be read ({exc}): give the pipeline folder with --pipeline") from exc


def write_card(folder: Path, base: Path, family: str, pipeline_class: str, source: str, config: dict, ema: bool,
               facts: dict, run: Path | None, adapter: tuple[str, list[str]] | None = None) -> None:
    """``folder/README.md`` (and ``samples.png`` when the run drew one) for the pipeline fine-tuned from ``base``:
    ``source`` says where the weights came from, ``facts`` the step, world size and strategy, ``run`` is the run
    directory (its samples); ``adapter``: the folder holds an adapter alone, (what it is, the lines that load it)."""
    step = facts.get("step")
    model = (config.get("model") or {}).get("init_args") or {}
    data = (config.get("data") or {}).get("init_args") or {}
    trainer = config.get("trainer") or {}
    objective = model.get("objective") or {}
    optimizer = model.get("optimizer") or {}
    world = int(facts.get("world_size") or 1)
    accumulate = int(trainer.get("accumulate_grad_batches") or 1)
    batch = int(data.get("batch_size_per_device") or 0) * world * accumulate
    lines = [
        "---",
        "library_name: diffusers",
        f"base_model: {base.name}",
        f"tags: [lit-dist, text-to-image, {_kind_tag(adapter)}]",
        "---",
        "",
        f"# {folder.name}",
        "",
    ]
    if adapter is None:
        lines += [f"A full fine-tune of `{base}` ({pipeline_class}, the {family} family) by lit-dist. Load it with "
                  "diffusers:", "", "```python", "from diffusers import DiffusionPipeline",
                  f'pipeline = DiffusionPipeline.from_pretrained("{folder.name}")']
    else:
        lines += [f"An adapter ({adapter[0]}) on `{base}` ({pipeline_class}, the {family} family), trained by lit-dist; "
                  "the folder holds the adapter alone. Load it onto its base:", "", "```python", *adapter[1]]
    lines += [
        "```",
        "",
        "## Training",
        "",
        f"- weights: {source}" + (" (its weight average)" if ema else ""),
    ]
    if step is not None:
        images = f", about {int(step) * batch:,} images seen ({batch} per step)" if batch else ""
        lines.append(f"- steps: {int(step):,}{images}")
    lines.append(f"- processes: {world}, strategy {facts.get('strategy') or trainer.get('strategy') or 'auto'}, "
                 f"precision {trainer.get('precision') or '32-true'}")
    if objective:
        args = objective.get("init_args") or {}
        shown = ", ".join(f"{k} {v}" for k, v in sorted(args.items()) if v is not None and k not in ("eval_seed",))
        lines.append(f"- objective: {objective.get('class_path', '').rsplit('.', 1)[-1]} ({shown})")
    if optimizer:
        args = optimizer.get("init_args") or {}
        lines.append(f"- optimizer: {optimizer.get('class_path', '').rsplit('.', 1)[-1]}, lr {args.get('lr')}, "
                     f"lr_scaling {model.get('lr_scaling', 'none')}, warmup {model.get('warmup_steps', 0)} steps")
    if data.get("resolution"):
        lines.append(f"- resolution: {data['resolution']} pixels (aspect-ratio buckets)")
    grid = _last_grid(run, step)
    if grid is not None:
        shutil.copy2(grid, folder / "samples.png")
        prompts = grid.with_suffix(".txt").read_text().splitlines() if grid.with_suffix(".txt").is_file() else []
        lines += ["", "## Samples", "", f"The run's last grid ({grid.stem}), one prompt per row:", "",
                  "![samples](samples.png)", ""]
        lines += [f"{i + 1}. {p}" for i, p in enumerate(prompts)]
    (folder / "README.md").write_text("\n".join(lines) + "\n")


def _kind_tag(adapter: tuple[str, list[str]] | None) -> str:
    if adapter is None:
        return "fine-tune"
    return "lora" if adapter[0].startswith("lora") else "lycoris"


def _last_grid(run: Path | None, step) -> Path | None:
    if run is None:
        return None
    grids = []
    for path in (run / "samples").glob("step-*.png"):
        match = re.fullmatch(r"step-(\d+)", path.stem)
        if match and (step is None or int(match.group(1)) <= int(step)):
            grids.append((int(match.group(1)), path))
    return max(grids)[1] if grids else None
