"""Preflight: measure an allocation before a long run, and name the ranks and nodes that lag behind.

At hundreds of GPUs one slow node (a degraded link, a throttled GPU, a busy or failing local disk)
slows the whole job for its whole life. A preflight of a minute finds it before the run starts.
On every rank (``srun lit-dist preflight --config cfg.yaml``, or ``fit`` with
``preflight.enabled: true`` before its first step):

- **matmul**: TFLOP/s of the rank's device (a bf16 8192 x 8192 product on a GPU, fp32 1024 on CPU);
- **all-reduce**: bus bandwidth (the nccl-tests convention: bytes x 2(n-1)/n per second) of the whole
  job, and of each node's ranks among themselves;
- **read**: MB/s reading the run's source images from the data root (each rank its own files);
- **write**: MB/s writing a file to the checkpoint folder (flushed and synced, then removed);
- **loader**: images/s of the run's training loader, as configured (workers, cache).

Rank 0 prints a table per node and rank and writes ``preflight.json`` into the run directory. Every
figure below ``min_fraction`` of the median (of the ranks, or of the nodes for the within-node
all-reduce) is named; if any is, every rank ends with exit code 14 (docs/exit-codes.md).
"""

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from lightning.pytorch import Callback

from lit_dist.errors import ConfigError, ExitCode, LitDistError
from lit_dist.runtime import outage

# Per-rank figures: (key, column title, unit).
RANK_FIGURES = (("matmul_tflops", "matmul", "TFLOP/s"), ("read_mb_s", "read", "MB/s"), ("write_mb_s", "write", "MB/s"),
                ("loader_images_s", "loader", "img/s"))


class PreflightFailed(LitDistError):
    """Some rank or node measured below ``min_fraction`` of the median."""

    exit_code = ExitCode.PREFLIGHT


@dataclass
class RankFigures:
    """What one rank measured (None: not measured, e.g. a dataset without files to read)."""

    rank: int
    host: str
    node: str
    matmul_tflops: float | None = None
    read_mb_s: float | None = None
    write_mb_s: float | None = None
    loader_images_s: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    ranks: list[RankFigures]
    job_busbw_gb_s: float | None  # the whole job's all-reduce
    node_busbw_gb_s: dict[str, float]  # each node's ranks among themselves (nodes with 2 or more ranks)
    outliers: list[str]
    min_fraction: float

    def table(self) -> str:
        nodes = sorted({r.node for r in self.ranks})
        lines = [f"lit-dist preflight: {_count(len(self.ranks), 'rank')} on {_count(len(nodes), 'node')}"]
        head = ["rank", "node", *(f"{title} {unit}" for _, title, unit in RANK_FIGURES)]
        rows = [[str(r.rank), r.node, *(_fmt(getattr(r, key)) for key, _, _ in RANK_FIGURES)] for r in self.ranks]
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        for row in [head, *rows]:
            lines.append("  " + "  ".join(cell.rjust(w) if i > 1 else cell.ljust(w)
                                          for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
        if self.job_busbw_gb_s is not None:
            lines.append(f"  all-reduce, whole job ({len(self.ranks)} ranks): {self.job_busbw_gb_s:.2f} GB/s bus bandwidth")
        for node, busbw in sorted(self.node_busbw_gb_s.items()):
            count = sum(r.node == node for r in self.ranks)
            lines.append(f"  all-reduce within {node} ({count} ranks): {busbw:.2f} GB/s bus bandwidth")
        for r in self.ranks:
            lines += [f"  note, rank {r.rank}: {note}" for note in r.notes]
        if self.outliers:
            lines.append(f"  below {self.min_fraction:g} x the median: " + "; ".join(self.outliers))
        else:
            lines.append(f"  no rank or node below {self.min_fraction:g} x the median")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise PreflightFailed (exit 14) on every rank if any figure lags."""
        if self.outliers:
            raise PreflightFailed(f"preflight: below {self.min_fraction:g} x the median: {'; '.join(self.outliers)}. "
                                  "Exclude those nodes (sbatch --exclude=...) or look at them; preflight.min_fraction "
                                  "sets the bar")

    def to_dict(self) -> dict:
        return {"ranks": [asdict(r) for r in self.ranks], "job_busbw_gb_s": self.job_busbw_gb_s,
                "node_busbw_gb_s": self.node_busbw_gb_s, "outliers": self.outliers, "min_fraction": self.min_fraction}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def outliers(ranks: list[RankFigures], node_busbw: dict[str, float], min_fraction: float) -> list[str]:
    """Every figure below ``min_fraction`` of its median, named: ranks per figure, nodes for their all-reduce."""
    found = []
    for key, title, unit in RANK_FIGURES:
        values = [(r, getattr(r, key)) for r in ranks if getattr(r, key) is not None]
        if len(values) < 2:
            continue
        median = float(np.median([v for _, v in values]))
        found += [f"rank {r.rank} ({r.node}) {title} {_fmt(v)} vs median {_fmt(median)} {unit}"
                  for r, v in values if v < min_fraction * median]
    if len(node_busbw) >= 2:
        median = float(np.median(list(node_busbw.values())))
        found += [f"node {node} all-reduce {v:.2f} vs median {median:.2f} GB/s"
                  for node, v in sorted(node_busbw.items()) if v < min_fraction * median]
    return found


# -- the measurements (every rank) -----------------------------------------------------------------

def matmul_tflops(device: torch.device, seconds: float) -> float:
    """TFLOP/s of square matrix products on ``device``, over at least ``seconds`` of them (a fixed count sized from
    one timed product would let a rank that was held up in that one measure a short, lucky window)."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    count, started = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        if cuda and count % 8:  # on a GPU, look at the clock (a sync) every 8 products
            continue
        if cuda:
            torch.cuda.synchronize(device)
        took = time.perf_counter() - started
        if took >= seconds:
            return 2 * n**3 * count / took / 1e12


def allreduce_busbw(nbytes: int, device: torch.device, seconds: float, group=None, ranks: int | None = None) -> float:
    """GB/s bus bandwidth of all-reduces of ``nbytes`` over ``group`` (every member calls it): the slowest
    member's time, as everyone waits for it."""
    import torch.distributed as dist

    n = ranks or dist.get_world_size()
    tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(tensor, group=group)  # warm-up: connections, buffers
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    once = time.perf_counter() - started
    times = torch.tensor([max(3, int(seconds / max(once, 1e-6)))], device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MIN, group=group)  # the same count on every member
    started = time.perf_counter()
    for _ in range(int(times.item())):
        dist.all_reduce(tensor, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    took = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    per_call = float(took.item()) / int(times.item())
    return nbytes * 2 * (n - 1) / n / per_call / 1e9


def read_mb_s(files: list[str], fs, seconds: float, limit_bytes: int) -> float | None:
    """MB/s reading whole files (this rank's share) until ``seconds`` or ``limit_bytes``; None without files."""
    if not files:
        return None
    read, started = 0, time.perf_counter()
    for path in files:
        with fs.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                read += len(chunk)
        if read >= limit_bytes or time.perf_counter() - started >= seconds:
            break
    return read / 1e6 / max(time.perf_counter() - started, 1e-9)


def write_mb_s(store, name: str, nbytes: int) -> float:
    """MB/s writing ``nbytes`` to ``name`` in the checkpoint folder (synced on local disks), then removing it."""
    block = os.urandom(1 << 20)
    path = store.path(name)
    store.fs.makedirs(store.root, exist_ok=True)
    started = time.perf_counter()
    try:
        with store.fs.open(path, "wb") as f:
            for _ in range(max(nbytes >> 20, 1)):
                f.write(block)
            if store.local:
                f.flush()
                os.fsync(f.fileno())
        took = time.perf_counter() - started
    finally:
        try:
            store.fs.rm(path)
        except FileNotFoundError:
            pass
    return max(nbytes >> 20, 1) * len(block) / 1e6 / max(took, 1e-9)


def loader_images_s(loader, seconds: float) -> float | None:
    """Images/s of ``loader`` after its first batch (the workers' start), over at least ``seconds`` (epoch after
    epoch if one is shorter: a small split would otherwise measure a burst); None if it serves nothing."""
    iterator = iter(loader)
    try:
        next(iterator)
    except StopIteration:
        return None
    images, started = 0, time.perf_counter()
    while True:
        for batch in iterator:
            first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
            images += int(first.shape[0])
            if time.perf_counter() - started >= seconds:
                return images / (time.perf_counter() - started)
        iterator = iter(loader)


# -- the whole preflight ----------------------------------------------------------------------------

class Preflight(Callback):
    """Preflight settings (the CLI's ``preflight`` group); with ``enabled``, the preflight at the start of fit."""

    def __init__(self, enabled: bool = False, min_fraction: float = 0.5, seconds: float = 2.0, io_mb: int = 64,
                 allreduce_mb: int = 64):
        """Preflight settings.

        Args:
            enabled: Run the preflight at the start of fit (before the first step); exit 14 if a rank or node lags.
            min_fraction: A figure below this fraction of the median (over ranks, or nodes) is an outlier (between 0 and 1).
            seconds: About how long each measurement runs.
            io_mb: MB each rank writes to the checkpoint folder, and at most reads from the data root.
            allreduce_mb: MB per all-reduce.
        """
        problems = []
        if not 0 < min_fraction < 1:
            problems.append(f"preflight.min_fraction = {min_fraction}: must be between 0 and 1 (0.5: half the median); "
                            "at 1 or more a rank is below the median in nearly every run, at 0 or less never")
        if seconds <= 0:
            problems.append(f"preflight.seconds = {seconds}: must be positive")
        if io_mb < 1:
            problems.append(f"preflight.io_mb = {io_mb}: must be at least 1")
        if allreduce_mb < 1:
            problems.append(f"preflight.allreduce_mb = {allreduce_mb}: must be at least 1")
        ConfigError.collect(problems)
        self.enabled = enabled
        self.min_fraction = min_fraction
        self.seconds = seconds
        self.io_mb = io_mb
        self.allreduce_mb = allreduce_mb
        self.checkpoint_store = None  # where the write test writes: set by the CLI (the checkpoint folder)

    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.enabled:
            return
        store = self.checkpoint_store
        if store is None:
            from lit_dist.ckpt.store import CheckpointStore

            store = CheckpointStore(trainer.default_root_dir)
        report = self.run(trainer.strategy.root_device, trainer.datamodule, store, trainer.default_root_dir)
        report.check()

    def run(self, device: torch.device, data, store, run_dir: str) -> Report:
        """Measure on every rank (every rank calls it, with the process group up and ``data`` set up for fit);
        rank 0 prints the table and writes preflight.json."""
        from lit_dist.runtime.distributed import Comm

        comm = Comm.current()
        mine = RankFigures(comm.rank, socket.gethostname(), os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        files, fs = _source_files(data, comm.rank, comm.world)
        if comm.rank == 0:  # the figures take a while on a large job: say what is under way
            print(f"lit-dist preflight: measuring {_count(comm.world, 'rank')} (matmul, reads, writes, loader, "
                  f"all-reduce: about {self.seconds:g} s each)", flush=True)
        # Every rank measures the same thing at the same time, as in training: reads and writes then share the
        # filesystem as a checkpoint save does, and ranks sharing a node's CPUs compete alike.
        comm.barrier()
        mine.matmul_tflops = matmul_tflops(device, self.seconds)
        comm.barrier()
        mine.read_mb_s = read_mb_s(files, fs, self.seconds, self.io_mb << 20)
        if mine.read_mb_s is None:
            mine.notes.append("no source files to read")
        comm.barrier()
        mine.write_mb_s = write_mb_s(store, f".preflight-{mine.node}-rank{comm.rank}", self.io_mb << 20)
        comm.barrier()
        mine.loader_images_s = loader_images_s(data.probe_loader(comm.world, comm.rank), self.seconds)
        job, node = self._allreduce(comm, mine.node, device) if comm.world > 1 else (None, None)
        gathered = comm.all_gather((mine, node))
        ranks = [figures for figures, _ in gathered]
        node_busbw = {figures.node: busbw for figures, busbw in gathered if busbw is not None}
        report = Report(ranks, job, node_busbw, outliers(ranks, node_busbw, self.min_fraction), self.min_fraction)
        if comm.rank == 0:
            print(report.table(), flush=True)
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "preflight.json"), "w") as f:
                json.dump(report.to_dict(), f, indent=1)
        return report

    def _allreduce(self, comm, node: str, device: torch.device) -> tuple[float, float | None]:
        """(the whole job's bus bandwidth, this node's among its ranks: from the node's first rank only, else None)."""
        import torch.distributed as dist

        job = allreduce_busbw(self.allreduce_mb << 20, device, self.seconds)
        by_node: dict[str, list[int]] = {}
        for rank, name in enumerate(comm.all_gather(node)):
            by_node.setdefault(name, []).append(rank)
        # Every rank makes every group, in the same order; then each node's ranks measure at the same time.
        groups = {name: dist.new_group(ranks) for name, ranks in sorted(by_node.items())}
        mine = by_node[node]
        busbw = None
        if len(mine) > 1:
            busbw = allreduce_busbw(self.allreduce_mb << 20, device, self.seconds, groups[node], len(mine))
        comm.barrier()
        return job, busbw if comm.rank == mine[0] else None


def _source_files(data, rank: int, world: int) -> tuple[list[str], object]:
    """This rank's share (every world-th) of the run's source image paths, and their filesystem."""

    files, fs = [], None
    for source, (meta, _, _) in zip(data.sources, data.read(), strict=True):
        fs, root = outage.url_to_fs(source.image_root, **(data.storage_options or {}))
        files += [f"{root.rstrip('/')}/{name}" for name in list(meta.filenames)[rank::world]]
    return files, fs
