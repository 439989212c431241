"""lit-dist fit vs a plain Lightning script: steps/s and time from command to first step.

Both train SimpleCNN on the same in-memory data (benchmarks.common.InMemoryData: 32x32
images, batch 64) with the same optimizer (AdamW), for the same number of steps, one process
each, runs alternating so that machine noise hits both alike; medians of ``--repeats`` runs.
lit-dist runs as a user's run would, with its progress lines and goodput journal. Steps/s
are timed after 20 warm-up steps (benchmarks.common.StepTimer); time to first step runs from
starting the command (interpreter start-up and imports included) to the first training batch.
Runs on a 2-core VM spread about +-15 %: a steps/s ratio above 1 there means no measurable
overhead, not a speed-up. Targets (issue 2): steps/s ratio >= 0.97, time-to-first-step
ratio <= 1.25.

    .venv/bin/python -m benchmarks.bench_fit_overhead [--repeats 5] [--steps 300] [--short]
"""

import argparse
import os
import statistics
import sys
import tempfile

from benchmarks.common import SHORT_HELP, machine, result_line, run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # past StepTimer's 20 warm-up steps
        args.repeats, args.steps = 1, 30
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-")
    bindir = os.path.dirname(sys.executable)
    lit = [os.path.join(bindir, "lit-dist"), "fit", "--trainer.max_steps", str(args.steps),
           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
           "--trainer.log_every_n_steps", "50", "--trainer.callbacks+=benchmarks.common.StepTimer",
           "--run.root_dir", tmp, "--run.name", "lit",
           "--model.net", "lit_dist.model.nets.SimpleCNN", "--model.net.num_classes", "4",
           "--model.optimizer.class_path", "torch.optim.AdamW", "--model.optimizer.init_args.lr", "0.001",
           "--data", "benchmarks.common.InMemoryData"]
    plain = [sys.executable, "-m", "benchmarks.plain_lightning", str(args.steps), os.path.join(tmp, "plain")]
    results: dict[str, list[dict]] = {"lit-dist": [], "plain": []}
    for i in range(args.repeats):
        for name, cmd in (("lit-dist", lit), ("plain", plain)) if i % 2 == 0 else (("plain", plain), ("lit-dist", lit)):
            results[name].append(run_bench(cmd))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("steps_per_s", "to_first_step_s")}
           for name, runs in results.items()}
    print(f"machine: {machine()}; {args.repeats} runs each, {args.steps} steps, medians")
    for name, m in med.items():
        print(f"  {name:9s} steps/s {m['steps_per_s']:8.2f}   command -> first step {m['to_first_step_s']:6.2f} s")
    speed = med["lit-dist"]["steps_per_s"] / med["plain"]["steps_per_s"]
    start = med["lit-dist"]["to_first_step_s"] / med["plain"]["to_first_step_s"]
    print(f"steps/s ratio (lit-dist / plain):         {speed:.3f}  (target >= 0.97) {'OK' if speed >= 0.97 else 'MISSED'}")
    print(f"time-to-first-step ratio (lit-dist/plain): {start:.3f}  (target <= 1.25) {'OK' if start <= 1.25 else 'MISSED'}")
    result_line("fit_overhead", round(speed, 4), ">= 0.97", speed >= 0.97,
                first_step_ratio=round(start, 4), first_step_target="<= 1.25", first_step_met=start <= 1.25,
                lit_dist_steps_per_s=round(med["lit-dist"]["steps_per_s"], 2),
                plain_steps_per_s=round(med["plain"]["steps_per_s"], 2),
                lit_dist_to_first_step_s=round(med["lit-dist"]["to_first_step_s"], 3),
                plain_to_first_step_s=round(med["plain"]["to_first_step_s"], 3),
                steps=args.steps, repeats=args.repeats, short=args.short)


if __name__ == "__main__":
    main()
