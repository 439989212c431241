"""``srun lit-dist preflight --config cfg.yaml``: measure the allocation before a long run; name the laggards.

    srun lit-dist preflight --config cfg.yaml                       # every task of a Slurm job
    lit-dist preflight --config cfg.yaml --trainer.devices 4        # four processes on this machine
    srun lit-dist preflight --config cfg.yaml --preflight.min_fraction 0.8

Per rank: matmul TFLOP/s, read MB/s from the data root, write MB/s to the checkpoint folder, loader
images/s; all-reduce bus bandwidth of the whole job and within each node. Exit 14 when a rank or node
is below preflight.min_fraction of the median. See lit_dist/callbacks/preflight.py.
"""

from typing import TYPE_CHECKING

from lit_dist.errors import ExitCode

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli.app import RunConfigCLI


def preflight(cli: "RunConfigCLI") -> int:
    """Measure the allocation on every rank (matmul, all-reduce, data reads, checkpoint writes, loader) and name
    the ranks and nodes below preflight.min_fraction of the median (exit 14).

    Args:
        cli: The run config, given as for fit: --config FILE and dotted overrides; the preflight group sets the bar.
    """
    from lit_dist.runtime.distributed import run_on_every_rank

    trainer = cli.instantiate_trainer()
    settings, checkpointing = cli.config_init["preflight"], cli.config_init["checkpoint"]
    return run_on_every_rank(trainer, lambda: _measure(trainer, cli.datamodule, settings, checkpointing))


def _measure(trainer, data, settings, checkpointing) -> int:
    from lit_dist.runtime.distributed import Comm

    comm = Comm.current()
    if trainer.local_rank == 0:  # as Lightning runs it: the demo data, and folder scans of a single process
        data.prepare_data()
    comm.barrier()
    data.setup("fit")
    report = settings.run(trainer.strategy.root_device, data, checkpointing.store(trainer), trainer.default_root_dir)
    report.check()  # every rank raises alike: exit 14
    return int(ExitCode.OK)
