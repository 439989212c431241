"""FSDP2 vs DDP on 2 CPU processes: parameter + gradient + optimizer memory per rank, ~56 M-parameter model.

Both run `lit-dist fit` on the same model (benchmarks.models.MLPClassifier, 56.7 M parameters at
the defaults), data and optimizer (AdamW); the count is of the tensors each rank holds at the end of
a step (benchmarks.common.StateMemory): under FSDP2 its shards. During a block's forward and backward
FSDP2 also holds that block whole (16 MiB at the defaults), which the count leaves out. Target
(issue 4): FSDP2 <= 0.6x DDP.

    .venv/bin/python -m benchmarks.bench_fsdp2_memory [--width 2048] [--depth 12] [--short]
"""

import argparse
import os
import sys
import tempfile

from benchmarks.common import SHORT_HELP, machine, result_line, run_bench


def run(strategy: list[str], args: argparse.Namespace, root: str) -> dict:
    cmd = [os.path.join(os.path.dirname(sys.executable), "lit-dist"), "fit", "--trainer.devices", "2",
           "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary",
           "false", "--trainer.enable_checkpointing", "false", "--export.filename", "null",
           "--trainer.callbacks+=benchmarks.common.StateMemory", "--run.root_dir", root,
           "--model.net", "benchmarks.models.MLPClassifier", "--model.net.width", str(args.width),
           "--model.net.depth", str(args.depth), "--data", "benchmarks.common.InMemoryData",
           "--data.num_samples", "256", "--data.batch_size_per_device", "8", *strategy]
    return run_bench(cmd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="MLPClassifier's width")
    parser.add_argument("--depth", type=int, default=12, help="MLPClassifier's residual blocks")
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:
        args.width, args.depth = 256, 2
    with tempfile.TemporaryDirectory(prefix="lit-dist-bench-") as root:
        ddp = run(["--trainer.strategy", "ddp"], args, root)
        fsdp2 = run(["--trainer.strategy", "lit_dist.strategies.fsdp.FSDP2Strategy",
                     "--trainer.strategy.block_classes", "[benchmarks.models.MLPBlock]"], args, root)
    mib = 2**20
    print(f"machine: {machine()}; {ddp['num_params'] / 1e6:.1f} M parameters, AdamW, 2 processes (gloo)")
    for name, r in (("DDP", ddp), ("FSDP2", fsdp2)):
        print(f"  {name:6s} per rank: params {r['params'] / mib:7.1f} MiB  grads {r['grads'] / mib:7.1f} MiB  "
              f"optimizer {r['optimizer'] / mib:7.1f} MiB  total {r['total'] / mib:7.1f} MiB")
    ratio = fsdp2["total"] / ddp["total"]
    print(f"ratio FSDP2 / DDP: {ratio:.2f}  (target <= 0.6) {'OK' if ratio <= 0.6 else 'MISSED'}")
    result_line("fsdp2_memory", round(ratio, 4), "<= 0.6", ratio <= 0.6,
                ddp_total_mib=round(ddp["total"] / mib, 1), fsdp2_total_mib=round(fsdp2["total"] / mib, 1),
                num_params=ddp["num_params"], short=args.short)


if __name__ == "__main__":
    main()
