"""What a run directory says about its run, finished or still going, without TensorBoard.

Read from what a run writes anyway: ``config.yaml`` (Lightning's copy of the parsed config), the
TensorBoard event files (metrics, throughput, goodput), the goodput journals (``goodput/``: every
attempt's start, saves, last step and how it ended) and the checkpoints' manifests.
"""

import inspect
import json
import os
import time
from dataclasses import dataclass, field

from lit_dist.errors import ConfigError
from lit_dist.watch import goodput

# The config groups `lit-dist fit` adds beside model and data, and the classes whose defaults they have.
GROUPS = {
    "trainer": "lightning.pytorch:Trainer",
    "run": "lit_dist.runtime.run_dir:RunConfig",
    "control": "lit_dist.runtime.control:RunControl",
    "progress": "lit_dist.callbacks.progress:Progress",
    "checkpoint": "lit_dist.callbacks.checkpoint:Checkpointing",
    "preemption": "lit_dist.callbacks.preemption:Preemption",
    "watchdog": "lit_dist.callbacks.watchdog:HangWatchdog",
    "straggler": "lit_dist.callbacks.stragglers:StragglerDetector",
    "preflight": "lit_dist.callbacks.preflight:Preflight",
    "export": "lit_dist.callbacks.export:ExportModel",
}
# Set by lit-dist for every run, not by the user: no news in a report (a key and everything under it).
FILLED_IN = ("trainer.default_root_dir", "trainer.logger", "run.run_id", "ckpt_path")
# Values Lightning or lit-dist put where the default is None: the default, spelled out.
SPELLED_OUT = {"trainer.precision": "32-true", "trainer.enable_progress_bar": False}


@dataclass
class Series:
    """One scalar over steps: the newest value written for each step (a resumed run writes some twice)."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    @property
    def last(self) -> tuple[int, float]:
        return self.steps[-1], self.values[-1]

    def best(self, higher_is_better: bool) -> tuple[int, float]:
        pick = max if higher_is_better else min
        value = pick(self.values)
        return self.steps[self.values.index(value)], value


@dataclass
class Report:
    """Everything ``lit-dist report`` shows."""

    run_dir: str
    differences: list[tuple[str, object, object]]  # (dotted key, value, default)
    scalars: dict[str, Series]
    attempts: list[dict]  # the goodput journals, oldest first
    checkpoints: list[dict]  # complete ones, newest first: name, step, bytes, time, reason
    now: float
    samples: list[str] = field(default_factory=list)  # the sample grids (samples/step-N.png), oldest first

    def state(self) -> str:
        """Finished, running (with ETA) or how it stopped."""
        if not self.attempts:
            return "no training step recorded (no goodput journal in the run directory)"
        last = self.attempts[-1]
        step, total = last["last_step"], last.get("total_steps")
        where = f"step {step}/{total} ({step / total:.0%})" if step is not None and total else f"step {step}"
        if last["ended"] == "finished":
            return f"finished at {where}"
        if last["ended"]:
            return f"stopped at {where}: {last['ended']}"
        if _alive(last, self.now):
            ago = self.now - (last["last_time"] or last["started"])
            eta = _eta(last)
            return f"running: {where}, last step {ago:.0f} s ago" + (f", ETA {goodput.hms(eta)}" if eta is not None else "")
        return f"stopped at {where} without a word (killed, or its node was lost)"

    def ledger(self) -> goodput.Ledger | None:
        """The goodput ledger as last logged (every logging window and at the end of fit)."""
        seconds = {name: self.scalars[f"goodput/{name}_s"].last[1] for name in goodput.CATEGORIES
                   if f"goodput/{name}_s" in self.scalars}
        if not seconds:
            return None
        redone = self.scalars.get("goodput/steps_redone")
        lost = [a for a in self.attempts[:-1] if a["ended"] != "finished"]
        return goodput.Ledger(dict.fromkeys(goodput.CATEGORIES, 0.0) | seconds, int(redone.last[1]) if redone else 0,
                              len(self.attempts) or 1, lost)

    def text(self) -> str:
        lines = [f"lit-dist report: {self.run_dir}", f"  state: {self.state()}"]
        if self.differences:
            lines.append("  config (differences from the defaults):")
            lines += [f"    {key}: {_show(value)}   (default: {_show(default)})" for key, value, default in self.differences]
        metrics = [(name, series) for name, series in sorted(self.scalars.items())
                   if name.split("/")[0] in ("train", "val", "test", "samples") and series.steps]
        if metrics:
            lines.append("  metrics:")
            for name, series in metrics:
                step, value = series.last
                line = f"    {name}: last {value:.4g} (step {step})"
                if name.startswith(("val/", "samples/")):
                    best_step, best = series.best(higher_is_better=not _lower_is_better(name))
                    line += f", best {best:.4g} (step {best_step})"
                lines.append(line)
        throughput = [f"{self.scalars['throughput/samples_per_s'].last[1]:,.0f} samples/s"] \
            if "throughput/samples_per_s" in self.scalars else []
        for tag, fmt in (("throughput/tflops_per_device", "{:.3g} TFLOP/s/device"), ("throughput/mfu", "MFU {:.0%}"),
                         ("throughput/data_wait", "data wait {:.0%}")):
            if tag in self.scalars:
                throughput.append(fmt.format(self.scalars[tag].last[1]))
        if throughput:
            lines.append(f"  throughput (last window): {', '.join(throughput)}")
        if self.samples:
            lines.append(f"  samples: {len(self.samples)} grid{'s' if len(self.samples) != 1 else ''}, newest "
                         f"{os.path.join(self.run_dir, self.samples[-1])}")
        ledger = self.ledger()
        if ledger is not None:
            lines.append(f"  {ledger.summary()}")
        if len(self.attempts) > 1:
            lines.append(f"  attempts: {len(self.attempts)}")
            for a in self.attempts:
                began = "from the start" if a["resumed_step"] is None else f"resumed at step {a['resumed_step']}"
                lines.append(f"    {a['attempt']}: {_when(a['started'])} on {a.get('host', '?')}, {began}, "
                             f"last step {a['last_step']}, {a['ended'] or 'no word'}")
        if self.checkpoints:
            newest = self.checkpoints[0]
            lines.append(f"  checkpoints: {len(self.checkpoints)} complete, newest {newest['name']} "
                         f"({newest['bytes'] / 1e6:.1f} MB, {newest['reason']}, {_when(newest['time'])})")
            lines += [f"    {c['name']}  {c['bytes'] / 1e6:9.1f} MB  {c['reason']}" for c in self.checkpoints[1:]]
        else:
            lines.append("  checkpoints: none complete")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Loss, accuracy, learning rate and throughput over steps, in one PNG (or any format matplotlib knows), with
        the newest sample grid beside them when the run has one."""
        import matplotlib
        import numpy as np

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [("loss", [t for t in self.scalars if t.endswith("loss") and t.split("/")[0] in ("train", "val")]),
                  ("accuracy", [t for t in self.scalars if (t.endswith("acc") and t.split("/")[0] in ("train", "val"))
                                or t == "samples/adherence"]),
                  ("learning rate", [t for t in self.scalars if t in ("train/lr",) or t.startswith("lr-")]),
                  ("samples/s", [t for t in ("throughput/samples_per_s",) if t in self.scalars])]
        if self.samples:
            figure = plt.figure(figsize=(16, 7))
            layout = figure.add_gridspec(2, 3, width_ratios=[1, 1, 0.9])
            first = figure.add_subplot(layout[0, 0])
            axes = np.array([[first, figure.add_subplot(layout[0, 1], sharex=first)],
                             [figure.add_subplot(layout[1, 0], sharex=first), figure.add_subplot(layout[1, 1], sharex=first)]])
            shown = figure.add_subplot(layout[:, 2])
            shown.imshow(plt.imread(os.path.join(self.run_dir, self.samples[-1])), interpolation="nearest")
            shown.set_title(f"samples at {os.path.basename(self.samples[-1])[:-4]}", fontsize=9)
            shown.axis("off")
        else:
            figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
        for ax, (title, tags) in zip(axes.flat, panels, strict=True):
            for tag in sorted(tags):
                series = self.scalars[tag]
                ax.plot(series.steps, series.values, label=tag, marker="o" if len(series.steps) < 30 else None,
                        markersize=3)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if tags:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        for ax in axes[1]:
            ax.set_xlabel("step")
        figure.suptitle(f"{self.run_dir}: {self.state()}", fontsize=10)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)


def read(run_dir: str, now: float | None = None) -> Report:
    """The report of the run in ``run_dir`` (a folder ``{root_dir}/{name}/{run_id}``)."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"run directory {run_dir!r} does not exist (it is {{run.root_dir}}/{{run.name}}/{{run.run_id}}, "
                        "e.g. runs/quickstart/slurm-4242)")
    config_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(config_path) and not os.path.isdir(os.path.join(run_dir, "goodput")):
        raise ConfigError(f"{run_dir!r} holds no config.yaml and no goodput/ folder: not a lit-dist run directory")
    differences = config_differences(config_path) if os.path.exists(config_path) else []
    grids = sorted(os.path.join("samples", name) for name in os.listdir(os.path.join(run_dir, "samples"))
                   if name.startswith("step-") and name.endswith(".png")) if os.path.isdir(os.path.join(run_dir, "samples")) else []
    return Report(run_dir, differences, scalars(run_dir), goodput.attempts(os.path.join(run_dir, "goodput")),
                  checkpoints(run_dir), time.time() if now is None else now, grids)


def scalars(run_dir: str) -> dict[str, Series]:
    """Every scalar of the run's TensorBoard event files (all attempts), the newest value per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    found = {}
    for tag in accumulator.Tags().get("scalars", []):
        newest: dict[int, tuple[float, float]] = {}
        for event in accumulator.Scalars(tag):
            if event.step not in newest or event.wall_time >= newest[event.step][0]:
                newest[event.step] = (event.wall_time, event.value)
        steps = sorted(newest)
        found[tag] = Series(steps, [newest[s][1] for s in steps])
    return found


def checkpoints(run_dir: str) -> list[dict]:
    """The run's complete checkpoints in its default folder, newest first (a remote dirpath is not listed)."""
    from lit_dist.ckpt.store import CheckpointStore

    folder = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    store = CheckpointStore(folder)
    found = []
    for name in store.complete():
        try:
            manifest = store.manifest(name)
        except (OSError, ValueError):  # unreadable or not JSON (truncated): `lit-dist export` names it, not here
            continue
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):  # JSON, but not a manifest
            continue
        found.append({"name": name, "step": manifest.get("step"), "reason": manifest.get("reason", "?"),
                      "bytes": sum(f.get("size", 0) for f in files.values() if isinstance(f, dict)),
                      "time": os.path.getmtime(os.path.join(folder, name))})
    return found


def config_differences(path: str) -> list[tuple[str, object, object]]:
    """(dotted key, value, default) for each setting of a saved config that differs from its class's default."""
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    found: list[tuple[str, object, object]] = []
    for group, value in config.items():
        if group in GROUPS and isinstance(value, dict):
            _compare(group, value, _defaults(GROUPS[group]), found)
        elif isinstance(value, dict) and "class_path" in value:
            _class_differences(group, value, found)
        elif group == "seed_everything" and value != 0:
            found.append((group, value, 0))
    return [(key, value, default) for key, value, default in found
            if not key.startswith(FILLED_IN) and not (key in SPELLED_OUT and SPELLED_OUT[key] == value)]


def _class_differences(key: str, value: dict, found: list) -> None:
    """A ``{class_path, init_args}`` section: its class if not the default one, then its arguments."""
    target = value["class_path"]
    if key not in ("model", "data"):  # those always name a class; elsewhere the choice itself is news
        found.append((f"{key}.class_path", target, None))
    module, _, name = target.rpartition(".")
    _compare(f"{key}.init_args", value.get("init_args") or {}, _defaults(f"{module}:{name}"), found)


def _compare(prefix: str, values: dict, defaults: dict | None, found: list) -> None:
    for name, value in values.items():
        key = f"{prefix}.{name}"
        if isinstance(value, dict) and "class_path" in value:
            _class_differences(key, value, found)
            continue
        if defaults is None or name not in defaults:
            found.append((key, value, "?"))
        elif _plain(value) != _plain(defaults[name]):  # a tuple default reads back from YAML as a list
            found.append((key, value, defaults[name]))


def _defaults(target: str) -> dict | None:
    """Default of every parameter of ``module:Class``'s constructor (None where it cannot be imported)."""
    import importlib

    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls.__init__).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    defaults = {}
    for p in parameters.values():
        if p.default is inspect.Parameter.empty:
            continue
        default = p.default
        if hasattr(default, "__dict__") and not isinstance(default, type):  # e.g. CacheConfig(): as the config shows it
            default = _plain(vars(default))
        defaults[p.name] = default
    return defaults


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def _alive(attempt: dict, now: float) -> bool:
    """Whether the attempt's process still runs: asked directly on its own host, else judged by its last step."""
    import socket

    if attempt.get("host") == socket.gethostname() and attempt.get("pid"):
        try:
            os.kill(int(attempt["pid"]), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    rate = _seconds_per_step(attempt)
    quiet = now - (attempt["last_time"] or attempt["started"])
    return quiet < max(600.0, 20 * rate) if rate else quiet < 600.0


def _seconds_per_step(attempt: dict) -> float | None:
    first, last_step, last_time = attempt.get("first_batch"), attempt["last_step"], attempt["last_time"]
    if not first or last_step is None or last_step <= first[0]:
        return None
    return (last_time - first[1]) / (last_step - first[0])


def _eta(attempt: dict) -> float | None:
    rate, total = _seconds_per_step(attempt), attempt.get("total_steps")
    return None if rate is None or not total else max(total - attempt["last_step"], 0) * rate


def _lower_is_better(name: str) -> bool:
    return any(word in name for word in ("loss", "error", "perplexity", "fid"))


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _show(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 100 else text[:97] + "..."
