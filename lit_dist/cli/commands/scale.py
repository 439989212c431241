"""``lit-dist scale --config cfg.yaml --devices 1,2,4``: measure how a run scales before buying more GPUs.

    lit-dist scale --config cfg.yaml --devices 1,2,4,8            # on one machine
    lit-dist scale --config cfg.yaml --devices 1,2 --steps 200    # longer timed fits
    lit-dist scale --config cfg.yaml --nodes 1,2,4 --devices 8    # in a Slurm allocation: srun per node count

Runs a short timed fit of the run config at each size with the same per-device batch, one after the
other, and prints samples/s, speedup and efficiency per size; writes scaling.json and the plot into
``{run.root_dir}/scale/``. See lit_dist/watch/scaling.py for what is measured.
"""

import os
from typing import TYPE_CHECKING

from lit_dist.errors import ConfigError, ExitCode

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli.app import RunConfigCLI


def scale(cli: "RunConfigCLI", devices: str | None = None, nodes: str | None = None, steps: int = 60, plot: str | None = None) -> int:
    """Timed fits of the run config at several sizes: samples/s, speedup and efficiency per size, and a plot.

    Args:
        cli: The run config, given as for fit: --config FILE and dotted overrides.
        devices: Device counts to measure on this machine, separated by commas (default 1,2); with --nodes, the
            devices (tasks) per node, one number (default 1).
        nodes: Node counts to measure with srun, one job step each (in a Slurm allocation of the largest count).
        steps: Optimizer steps per timed fit; the first sixth is warm-up and not counted.
        plot: Where to draw speedup and efficiency; default {run.root_dir}/scale/scaling.png.
    """
    from lit_dist.watch import scaling

    if nodes:
        per_node = scaling.parse_sizes(devices or "1")
        if len(per_node) != 1:
            raise ConfigError(f"--devices {devices!r} with --nodes: one number, the devices (tasks) per node")
        layouts = [scaling.Layout(n * per_node[0], n, per_node[0]) for n in scaling.parse_sizes(nodes, "--nodes")]
    else:
        layouts = [scaling.Layout(d) for d in scaling.parse_sizes(devices or "1,2")]
    if steps < 2 * scaling.WINDOWS:
        raise ConfigError(f"--steps {steps}: at least {2 * scaling.WINDOWS} (the first sixth is warm-up)")
    config = cli.config
    if config.trainer.num_nodes not in (None, 1):
        raise ConfigError(f"trainer.num_nodes = {config.trainer.num_nodes}: lit-dist scale sets the node count of each "
                          "timed fit itself (--nodes); run it without trainer.num_nodes")
    root = config.run.root_dir
    strategy = config.trainer.strategy if isinstance(config.trainer.strategy, str) else None
    measured = scaling.measure(cli.args, layouts, steps, root, strategy)
    print(scaling.table(measured))
    folder = os.path.join(root, "scale")
    scaling.save(measured, os.path.join(folder, "scaling.json"))
    target = plot or os.path.join(folder, "scaling.png")
    scaling.plot(measured, target, f"{config.run.name}: {steps} steps per size, "
                 f"{cli.datamodule.batch_size_per_device} samples per device per step")
    print(f"lit-dist scale: {os.path.join(folder, 'scaling.json')}, plot {target}")
    return int(ExitCode.OK)
