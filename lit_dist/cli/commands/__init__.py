"""Every ``lit-dist`` subcommand, in one table: Lightning's (run by LightningCLI) and lit-dist's own.

lit-dist's own commands live one per module in this folder. A command whose arguments are its
function's typed signature and docstring (``index``, ``export``) is run by jsonargparse's ``CLI``.
A command that takes the run config like ``fit`` (``plan``, ``cache``) gets it parsed, with the
model and data module built and no Trainer (``cli.instantiate_trainer()`` builds one), plus its
own flags: the function's further parameters, parsed by jsonargparse from its signature like the
other commands' arguments (``--name VALUE`` or ``--name=VALUE``; a bool alone, ``--check``, means true).
"""

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One of lit-dist's own subcommands."""

    target: str  # "module:function"
    help: str  # its line in `lit-dist --help`
    run_config: bool = False  # takes the run config like fit; else its signature is its arguments
    # A parameter with a default that may also come first without its flag (``lit-dist index ROOT``): jsonargparse
    # makes only parameters without a default positional, and this one is optional (``--webdataset`` instead).
    positional: str | None = None
    # A run-config command's parameter naming a checkpoint: without --config, the run config is the config.yaml of
    # the run directory that holds it (``lit-dist sample CKPT``).
    config_of: str | None = None

    def function(self):
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


# Lightning's subcommands: LightningCLI runs them; their lines in `lit-dist --help`.
LIGHTNING = {
    "fit": "train on the run config, validating every epoch; the same run again resumes its newest checkpoint",
    "validate": "val/* metrics of a checkpoint (--ckpt_path)",
    "test": "test/* metrics of a checkpoint (the test split, else val)",
    "predict": "predictions of a checkpoint, one parquet file per rank in the run directory",
}

COMMANDS = {
    "plan": Command("lit_dist.cli.commands.plan:plan", "check a run before it starts: world size, batches, learning rate, "
                    "buckets, problems (no GPU)", run_config=True),
    "index": Command("lit_dist.cli.commands.index:index", "index a folder of images into a parquet metadata table, or "
                     "tar shards or a Hugging Face dataset into a run's index", positional="root"),
    "export": Command("lit_dist.cli.commands.export:export", "write any checkpoint's network: a diffusers folder, safetensors or a state_dict"),
    "report": Command("lit_dist.cli.commands.report:report", "summarise a run directory, finished or running: state, ETA, "
                      "metrics, throughput, goodput, restarts, checkpoints (--plot report.png)"),
    "scale": Command("lit_dist.cli.commands.scale:scale", "timed fits at several device counts: samples/s, speedup and "
                     "efficiency per size, and a plot (--devices 1,2,4)", run_config=True),
    "preflight": Command("lit_dist.cli.commands.preflight:preflight", "measure the allocation on every rank (matmul, "
                         "all-reduce, data reads, checkpoint writes, loader) and name the laggards", run_config=True),
    "sample": Command("lit_dist.cli.commands.sample:sample", "images from a generative run's checkpoint as a PNG grid "
                      "(--prompt \"a red circle on a white background\" --num 8 --guidance 4)", run_config=True,
                      positional="checkpoint", config_of="checkpoint"),
    "cache": Command("lit_dist.cli.commands.cache:cache", "build the run's cache of pixels / encoder outputs on every rank "
                     "(--check: report on it)", run_config=True),
}

NAMES = (*LIGHTNING, *COMMANDS)


def usage() -> str:
    """The text of ``lit-dist --help``: every subcommand with its line."""
    width = max(map(len, NAMES))
    lines = [f"  {name:<{width}}  {text}" for name, text in {**LIGHTNING, **{n: c.help for n, c in COMMANDS.items()}}.items()]
    return ("usage: lit-dist COMMAND [options]\n\n"
            "lit-dist: training from one YAML file.\n\n"
            "commands:\n" + "\n".join(lines) + "\n\n"
            "`lit-dist COMMAND --help` lists a command's options, e.g. `lit-dist fit --help` every knob of a run.\n")
