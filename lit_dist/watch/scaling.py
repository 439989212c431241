"""Scaling: short timed fits of one run config at several sizes, and what they say (``lit-dist scale``).

Every size trains ``steps`` optimizer steps with the config's per-device batch (weak scaling: the global
batch grows with the devices), without validation, checkpoints or export. Throughput is the median of
the ``throughput/samples_per_s`` windows the run logged, the first window left out (it holds the FLOP
count's step, allocator and loader warm-up). Speedup is ``S_N / S_1`` and efficiency ``S_N / (N x S_1)``
(the same as T1 / (N x TN) in time per sample), against the smallest size measured, scaled to one device
when that is not 1.
"""

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

from lit_dist.errors import ConfigError, LitDistError

WINDOWS = 6  # logging windows per timed fit; the first is warm-up


@dataclass
class Size:
    """One timed fit."""

    devices: int  # in all: nodes x devices per node
    samples_per_s: float
    windows: int  # windows the median is over
    run_dir: str
    nodes: int = 1
    speedup: float = 0.0
    efficiency: float = 0.0


@dataclass(frozen=True)
class Layout:
    """One size to measure: on this machine (``nodes`` None) or under Slurm, ``nodes`` x ``per_node`` tasks."""

    devices: int
    nodes: int | None = None
    per_node: int = 1

    @property
    def name(self) -> str:
        return f"nodes-{self.nodes}" if self.nodes else f"devices-{self.devices}"

    def launch(self) -> list[str]:
        """What starts the fit: this Python, or srun on ``nodes`` nodes (a job step inside an allocation)."""
        fit = [sys.executable, "-m", "lit_dist", "fit"]
        if self.nodes is None:
            return fit
        return ["srun", f"--nodes={self.nodes}", f"--ntasks-per-node={self.per_node}", *fit]


def parse_sizes(text: str, flag: str = "--devices") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; a ConfigError names what is wrong."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"{flag} {text!r}: give counts separated by commas, each >= 1, e.g. {flag} 1,2,4")
    return sizes


def fit_args(config_args: list[str], layout: Layout, steps: int, root: str, strategy: str | None) -> list[str]:
    """The command line of one timed fit: the run config, then the overrides that make it a measurement."""
    devices = layout.per_node if layout.nodes else layout.devices
    args = [*config_args, "--trainer.devices", str(devices), "--trainer.num_nodes", str(layout.nodes or 1),
            "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
            "--trainer.log_every_n_steps", str(max(steps // WINDOWS, 1)),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
            "--checkpoint.every_n_epochs", "null", "--checkpoint.every_n_steps", "null",
            "--checkpoint.every_n_minutes", "null", "--checkpoint.save_last", "false", "--ckpt_path", "null",
            "--export.filename", "null", "--trainer.enable_progress_bar", "false",
            "--run.root_dir", root, "--run.name", "scale", "--run.run_id", layout.name]
    if layout.devices > 1 and strategy in (None, "auto"):
        args += ["--trainer.strategy", "ddp"]
    return args


def measure(config_args: list[str], layouts: list[Layout], steps: int, root: str, strategy: str | None,
            timeout_s: float = 3600.0) -> list[Size]:
    """Run the timed fit of every size, one after the other, and read their throughput."""
    from lit_dist.watch.report import scalars

    found = []
    for layout in layouts:
        devices = layout.devices
        run_dir = os.path.join(root, "scale", layout.name)
        if os.path.isdir(run_dir):  # an earlier measurement's: its event files would mix with this one's
            import shutil

            shutil.rmtree(run_dir)
        where = f"{layout.nodes} node{'s' if layout.nodes > 1 else ''} x {layout.per_node}" if layout.nodes else ""
        print(f"lit-dist scale: {devices} device{'s' if devices > 1 else ''}{f' ({where})' if where else ''}, "
              f"{steps} steps ...", flush=True)
        command = [*layout.launch(), *fit_args(config_args, layout, steps, root, strategy)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            said = [line for line in lines if line.startswith("lit-dist: error:")]
            why = said[-1] if said else "the end of its log:\n" + "\n".join(lines[-15:])
            error = LitDistError(f"the timed fit on {devices} devices failed (exit {done.returncode}); its run directory "
                                 f"is {run_dir}; {why}")
            if done.returncode > 0:  # its documented exit code (2: config, 3: data, ...) is this command's
                error.exit_code = done.returncode
            raise error
        series = scalars(run_dir).get("throughput/samples_per_s")
        windows = series.values[1:] if series is not None else []
        if not windows:
            raise ConfigError(f"the timed fit on {devices} devices logged fewer than 2 throughput windows: "
                              f"give more --steps (now {steps}; at least {2 * WINDOWS})")
        found.append(Size(devices, statistics.median(windows), len(windows), run_dir, layout.nodes or 1))
    base = found[0].samples_per_s / found[0].devices  # per device, at the smallest size
    for size in found:
        size.speedup = size.samples_per_s / base
        size.efficiency = size.samples_per_s / (size.devices * base)
    return found


def table(sizes: list[Size]) -> str:
    lines = [f"{'nodes':>6}  {'devices':>8}  {'samples/s':>12}  {'speedup':>8}  {'efficiency':>10}"]
    lines += [f"{s.nodes:>6}  {s.devices:>8}  {s.samples_per_s:>12,.1f}  {s.speedup:>8.2f}  {s.efficiency:>10.0%}"
              for s in sizes]
    return "\n".join(lines)


def save(sizes: list[Size], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(s) for s in sizes], f, indent=1)


def plot(sizes: list[Size], path: str, title: str) -> None:
    """Speedup against the ideal line, and efficiency, over device counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = [s.devices for s in sizes]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(devices, devices, "--", color="grey", label="ideal")
    left.plot(devices, [s.speedup for s in sizes], "o-", label="measured")
    left.set(xlabel="devices", ylabel="speedup (vs one device)", title="speedup")
    left.legend()
    right.bar([str(d) for d in devices], [s.efficiency * 100 for s in sizes])
    right.axhline(100, color="grey", linestyle="--")
    right.set(xlabel="devices", ylabel="%", title="scaling efficiency", ylim=(0, max(110, *(s.efficiency * 100 + 10 for s in sizes))))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
