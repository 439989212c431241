"""Where a training step's time goes: host-device synchronisations per step (all, and lit-dist's own), lit-dist's
callbacks' share of the step, the data-wait fraction, MFU, and a torch.profiler trace.

Two `lit-dist fit` runs on one device, each with ``StepProfile`` added to its callbacks:

- quickstart: configs/quickstart.yaml (SimpleCNN, the demo shapes from parquet, one loader worker) with every
  per-step participant on: run control, preemption, the checkpoint timer, progress, the watchdog and the GPU
  circuit breaker (real NVML on a GPU, the NVML test double on CPU, 0.2 s polls).
- reference: bench_strategies' model (benchmarks.models.MLPClassifier, ~420 M parameters on a GPU), the DDP
  preset, random in-memory images, batch 256.

``StepProfile`` measures a window of optimizer steps after a warm-up: the host time spent in the per-step hooks
of each lit-dist callback (each hook wrapped with a timer) against the window's wall time; the host time between
one batch's end and the next one's start (the data wait); and, on CUDA, every synchronisation that
``torch.cuda.set_sync_debug_mode("warn")`` reports, with the innermost frame outside torch and Lightning. After the
window it records a few steps with torch.profiler (CPU and CUDA activities) into ``{run dir}/trace.json.gz`` and
counts the synchronising CUDA runtime calls in them. MFU and throughput come from `lit-dist report` on the run.

    .venv/bin/python -m benchmarks.profile_step [--runs quickstart reference] [--steps 150] [--out DIR] [--short]

Targets (issue 31): no synchronisation from lit-dist's code in a steady-state step (the ratio reported is
lit-dist's synchronisations per step, target 0); lit-dist's callbacks <= 2 % of the step's wall time.
"""

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter

import lightning
import torch
from lightning.pytorch import Callback

import lit_dist
from benchmarks.common import ROOT, SHORT_HELP, command, machine, parse_bench, result_line

# The hooks Lightning calls on every training step; the others run once per epoch or per run.
STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad")
# CUDA runtime calls that block the host until the device has caught up (as torch.profiler names them).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
              "cudaMemcpy\0", "cudaStreamWaitEvent_host")


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# By folder, not by a "/torch/" in the path: a virtual environment may itself live under a folder named torch.
TORCH_DIR, LIGHTNING_DIR, LIT_DIST_DIR = _package_dir(torch), _package_dir(lightning), _package_dir(lit_dist)


def sync_site(stack) -> str:
    """Where a synchronisation came from: the innermost frame outside torch and the warnings machinery, as
    ``lit_dist/...:line`` (lit-dist's code), ``lightning/...:line`` (Lightning's loop) or another ``file:line``."""
    for frame in reversed(stack):
        path = os.path.abspath(frame.filename)
        if path.startswith(TORCH_DIR) or path.endswith((os.sep + "warnings.py", os.sep + "profile_step.py")):
            continue
        for name, folder in (("lit_dist", LIT_DIST_DIR), ("lightning", LIGHTNING_DIR)):
            if path.startswith(folder):
                return f"{name}/{os.path.relpath(path, folder)}:{frame.lineno}"
        return f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}:{frame.lineno}"
    return "unknown"


class StepProfile(Callback):
    """Profiles steps ``start`` to ``start + steps`` of this rank (see the module's docstring), then
    ``trace_steps`` more under torch.profiler; prints one ``BENCH`` line on rank 0 at the end."""

    def __init__(self, start: int = 30, steps: int = 100, trace_steps: int = 5):
        super().__init__()
        self.start, self.steps, self.trace_steps = start, steps, trace_steps
        self.hook_s: Counter = Counter()
        self.syncs: Counter = Counter()  # site -> synchronisations in the window
        self.sync_steps: Counter = Counter()  # global step -> synchronisations in it
        self.trainer = None
        self.waiting = 0.0
        self.batch_ended_at: float | None = None
        self.window: tuple[float, float] | None = None
        self.began: float | None = None
        self.state = "before"  # before -> window -> trace -> done
        self.profiler = None
        self.trace: dict = {}
        self.run_dir = None

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer
        for callback in trainer.callbacks:
            if not type(callback).__module__.startswith("lit_dist"):
                continue
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(Callback, hook):
                    setattr(callback, hook, self._timed(type(callback).__name__, getattr(callback, hook)))

    def _timed(self, name: str, hook):
        def timed(*args, **kwargs):
            if self.state != "window":
                return hook(*args, **kwargs)
            began = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.hook_s[name] += time.perf_counter() - began
        return timed

    def _record_sync(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            self.syncs[sync_site(traceback.extract_stack()[:-1])] += 1
            self.sync_steps[self.trainer.global_step] += 1
        else:
            self._showwarning(message, category, filename, lineno, file, line)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self.state == "window" and self.batch_ended_at is not None:
            self.waiting += now - self.batch_ended_at
        if self.state == "before" and trainer.global_step >= self.start:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # outside the window: it starts with the device caught up
                self._showwarning = warnings.showwarning
                warnings.showwarning = self._record_sync
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
            self.state, self.began = "window", time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.state == "window" and trainer.global_step >= self.start + self.steps:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = self._showwarning
                torch.cuda.synchronize()  # the window's work done on the device too (one sync, after it)
            self.window = (self.began, time.perf_counter())
            self.state = "trace"
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.traced_from = trainer.global_step
        elif self.state == "trace" and trainer.global_step >= self.traced_from + self.trace_steps:
            self._end_trace(trainer)
        self.batch_ended_at = time.perf_counter()

    def _end_trace(self, trainer):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.state = "done"
        steps = trainer.global_step - self.traced_from
        names = Counter(e.name for e in self.profiler.events())
        sync = {name: n for name, n in names.items() if any((name + "\0").startswith(s) for s in SYNC_CALLS)}
        run_dir = self.run_dir = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
        if trainer.is_global_zero:
            raw = os.path.join(run_dir, "trace.json")
            self.profiler.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = self.profiler.key_averages().table(sort_by=sort, row_limit=25)
            with open(os.path.join(run_dir, "trace-top.txt"), "w") as f:
                f.write(table)
        self.trace = {"trace_steps": steps, "sync_calls_per_step": {k: v / steps for k, v in sorted(sync.items())}}

    def on_train_end(self, trainer, pl_module):
        if self.state == "trace":
            self._end_trace(trainer)
        if self.window is None:
            raise RuntimeError(f"StepProfile: the run ended at step {trainer.global_step}, before its window "
                               f"(steps {self.start} to {self.start + self.steps}) was over; train longer")
        seconds = self.window[1] - self.window[0]
        lit = {k: v for k, v in self.syncs.items() if k.startswith("lit_dist/")}
        if trainer.is_global_zero:
            print("BENCH " + json.dumps({
                "window_steps": self.steps, "seconds_per_step": seconds / self.steps,
                "callbacks_share": sum(self.hook_s.values()) / seconds,
                "callbacks_ms_per_step": {k: round(1e3 * v / self.steps, 4) for k, v in self.hook_s.most_common()},
                "data_wait": self.waiting / seconds,
                "syncs_per_step": sum(self.syncs.values()) / self.steps,
                "lit_dist_syncs_per_step": sum(lit.values()) / self.steps,
                "steps_with_syncs": len(self.sync_steps), "log_every_n_steps": trainer.log_every_n_steps,
                "sync_sites": {k: v / self.steps for k, v in self.syncs.most_common(12)},
                "cuda_debug_mode": torch.cuda.is_available(), "run_dir": self.run_dir, **self.trace}), flush=True)


def fit(name: str, args: argparse.Namespace, root: str) -> dict:
    cuda = torch.cuda.is_available()
    steps = args.start + args.steps + args.trace_steps + 5
    common = ["--trainer.devices", "1", "--trainer.max_steps", str(steps), "--trainer.max_epochs", "1000",
              "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
              "--trainer.enable_model_summary", "false", "--export.filename", "null", "--run.root_dir", root,
              "--run.run_id", name, "--trainer.log_every_n_steps", "10", "--progress.log_every_s", "5"]
    if name == "quickstart":
        # Oversubscription: a short run's few images leave a bucket under one batch (2,000 leave none).
        cmd = ["--config", "configs/quickstart.yaml", "--data.metadata", os.path.join(root, "shapes", "metadata.parquet"),
               "--data.batch_size_per_device", str(args.quickstart_batch), "--data.allow_oversubscription", "true",
               "--checkpoint.every_n_epochs", "null",
               "--checkpoint.every_n_minutes", "30", "--checkpoint.save_last", "false",
               "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
               "--trainer.callbacks.poll_interval_s", "0.2"]
        if not cuda:
            cmd += ["--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml", "--trainer.callbacks.device_index", "0"]
    else:
        cmd = ["--config", "configs/ddp.yaml", "--trainer.enable_checkpointing", "false",
               "--model.net", "benchmarks.models.MLPClassifier", "--model.net.width", str(args.width),
               "--model.net.depth", str(args.depth), "--data", "benchmarks.common.InMemoryData",
               "--data.num_samples", str(steps * args.batch), "--data.batch_size_per_device", str(args.batch)]
    if not cuda:
        cmd += ["--trainer.accelerator", "cpu"]
    cmd = [sys.executable, "-m", "lit_dist", "fit", *cmd, *common, "--trainer.callbacks+=benchmarks.profile_step.StepProfile",
           "--trainer.callbacks.start", str(args.start), "--trainer.callbacks.steps", str(args.steps),
           "--trainer.callbacks.trace_steps", str(args.trace_steps)]
    env = {}
    if not cuda:
        state = os.path.join(root, "nvml.json")
        with open(state, "w") as f:
            json.dump({"0": {}}, f)
        env["FAKE_NVML_STATE"] = state
    result = parse_bench(command(cmd, env).stdout)
    report = command([sys.executable, "-m", "lit_dist", "report", result["run_dir"]], env, check=False)
    result["report"] = report.stdout.strip() or report.stderr.strip()[-1000:]
    return result


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["quickstart", "reference"], choices=["quickstart", "reference"])
    parser.add_argument("--start", type=int, default=30, help="warm-up steps before the window")
    parser.add_argument("--steps", type=int, default=150 if cuda else 40, help="steps in the window")
    parser.add_argument("--trace-steps", type=int, default=5)
    parser.add_argument("--quickstart-batch", type=int, default=32)
    parser.add_argument("--images", type=int, default=2000, help="demo shapes of the quickstart run")
    parser.add_argument("--width", type=int, default=4096 if cuda else 512)
    parser.add_argument("--depth", type=int, default=24 if cuda else 2)
    parser.add_argument("--batch", type=int, default=256 if cuda else 16)
    parser.add_argument("--out", help="copy each run's trace.json.gz and trace-top.txt here (as NAME-...)")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # both runs, each with a window and a trace
        args.start, args.steps, args.trace_steps, args.images = 2, 3, 1, 200
        args.width, args.depth, args.batch = 64, 1, 4
    where = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"machine: {machine()}; {where}; window of {args.steps} steps after {args.start}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="lit-dist-profile-") as root:
        if "quickstart" in args.runs:
            from lit_dist.data.demo.shapes import create_shapes_dataset

            create_shapes_dataset(os.path.join(root, "shapes", "metadata.parquet"), num_images=args.images, seed=0)
        for name in args.runs:
            r = fit(name, args, root)
            results[name] = {k: v for k, v in r.items() if k not in ("report", "run_dir")}
            print(f"\n== {name}: {r['seconds_per_step'] * 1e3:.2f} ms/step; lit-dist callbacks "
                  f"{r['callbacks_share']:.2%} of it; data wait {r['data_wait']:.1%}; synchronisations per step: "
                  f"{r['syncs_per_step']:.2f} in all, {r['lit_dist_syncs_per_step']:.2f} from lit-dist; "
                  f"{r['steps_with_syncs']} of {r['window_steps']} steps had any (metrics are logged every "
                  f"{r['log_every_n_steps']})")
            for site, n in r["sync_sites"].items():
                print(f"   {n:6.2f}/step  {site}")
            for callback, ms in r["callbacks_ms_per_step"].items():
                print(f"   {ms:8.4f} ms/step  {callback}")
            if r.get("sync_calls_per_step"):
                print(f"   profiler, synchronising CUDA calls per step: {r['sync_calls_per_step']}")
            print("   " + r["report"].replace("\n", "\n   "))
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                for f in ("trace.json.gz", "trace-top.txt"):
                    if os.path.exists(os.path.join(r["run_dir"], f)):
                        shutil.copy(os.path.join(r["run_dir"], f), os.path.join(args.out, f"{name}-{f}"))
    lit_syncs = max(r["lit_dist_syncs_per_step"] for r in results.values())
    share = max(r["callbacks_share"] for r in results.values())
    met = lit_syncs == 0 and share <= 0.02 if cuda else None
    result_line("profile_step", lit_syncs, "0 lit-dist syncs per step (CUDA only)", met, callbacks_share=round(share, 5),
                callbacks_target="<= 0.02", device=where, runs=results, short=args.short)


if __name__ == "__main__":
    main()
