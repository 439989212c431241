"""``lit-dist cache --config cfg.yaml``: build the run's cache on every rank; ``--check``: report on it.

    lit-dist cache --config cfg.yaml                         # one process
    lit-dist cache --config cfg.yaml --trainer.devices 4     # four processes on this machine
    srun lit-dist cache --config cfg.yaml                    # every task of a Slurm job
    lit-dist cache --config cfg.yaml --check                 # coverage, damage, bytes, compression
"""

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from lit_dist.errors import ConfigError, ExitCode

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli.app import RunConfigCLI


def cache(cli: "RunConfigCLI", check: bool = False) -> int:
    """Build the run's cache of pixels / encoder outputs on every rank, or report on it; returns the exit code.

    Args:
        cli: The run config, given as for fit: --config FILE and dotted overrides.
        check: Report coverage, damaged shards, bytes on disk and compression instead of building
            (exit 3 when the cache is incomplete or damaged).
    """
    data = cli.datamodule
    if getattr(data, "cache", None) is None:
        raise ConfigError("data.cache.dir is not set (or data.cache.mode is off): nothing to build. Add e.g. "
                          "data: {cache: {dir: /scratch/cache, pixels: true}}, or --data.cache.dir DIR, then run "
                          "lit-dist cache again.")
    if check:
        return check_cache(data)
    from lit_dist.runtime.distributed import run_on_every_rank

    trainer = cli.instantiate_trainer()
    return run_on_every_rank(trainer, lambda: _build(trainer, data))


def _build(trainer, data) -> int:
    from lit_dist.runtime.distributed import Comm

    comm = Comm.current()
    if trainer.local_rank == 0:  # as Lightning runs it: the demo data, and folder scans of a single process
        data.prepare_data()
    comm.barrier()
    if comm.world > 1:
        data.index_folders()  # every rank reads a share of the headers
    plan, report = data.build_cache(trainer.strategy.root_device, verify=True)
    if trainer.global_rank == 0:
        written = (f"{report['shards']} shards, {report['bytes'] / 1e6:.1f} MB written (compression "
                   f"{report['raw_bytes'] / report['bytes']:.2f}x)" if report["bytes"] else "nothing to write")
        print(f"lit-dist cache: built {report['samples']} samples on {report['ranks']} ranks in "
              f"{report['seconds']:.1f} s ({report['samples'] / max(report['seconds'], 1e-9):.0f} samples/s); "
              f"{report['unreadable']} unreadable sources recorded; {written}", flush=True)
        found, coverage = plan.match()
        for c in coverage.values():
            print(f"  {c.summary()}", flush=True)
        print(f"  cache: {data.cache.dir}", flush=True)
    return int(ExitCode.OK)


def check_cache(data) -> int:
    """Print coverage, damaged shards, bytes on disk and the compression ratio; 0 when complete and intact."""
    plan = data.cache_plan(data.read())
    store = plan.store
    if not store.check():
        print(f"lit-dist cache --check: no cache at {data.cache.dir} yet; build it with lit-dist cache --config ...")
        return int(ExitCode.DATA_ERROR)
    found, coverage = plan.match()
    bad = False
    print(f"lit-dist cache --check: {data.cache.dir}")
    for name in plan.fields:
        shards = store.manifest(name)["shards"]
        with ThreadPoolExecutor(4) as pool:  # hashlib releases the GIL
            problems = list(pool.map(lambda s, name=name: store.shard_problem(name, s, True), shards))
        damaged = [(s, p) for s, p in zip(shards, problems, strict=True) if p]
        c = coverage[name]
        print(f"  {c.summary()}")
        if c.stale and (other := plan.describe_other(name, c.other_configs)):
            print(f"    {other}")
        print(f"    {store.size_summary(name)} ({data.cache.compression})")
        for shard, problem in damaged:
            print(f"    damaged: shard {shard['name']}: {problem}; its {shard['samples']} samples are rebuilt by "
                  "lit-dist cache")
        bad |= bool(damaged) or c.missing > 0
    print(f"  bytes on disk: {store.bytes_on_disk() / 1e6:.1f} MB")
    if bad:
        print("  incomplete or damaged: run `lit-dist cache --config <this config>` to build what is missing")
    return int(ExitCode.DATA_ERROR if bad else ExitCode.OK)
