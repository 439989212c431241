"""FSDP2's sharded checkpoints of a ~530 MB state (44 M parameters + AdamW) on 2 CPU processes, inside one run:

- stall: how long training stops for an asynchronous sharded save (each rank copies its shards aside, then
  writes them on a thread over a gloo group of its own) vs a synchronous one (target, issue 29: <= 0.15x). The
  asynchronous figure includes any wait for the previous write.
- throughput per rank: a synchronous sharded save (the state taken from the model and optimizer, every rank its
  shard file through torch.distributed.checkpoint, sha256 while writing, fsync, the marker once all are in; DCP's
  per-tensor zip crc32 off, as in every lit-dist sharded save: the manifest's sha256 covers every byte) vs
  what a hand-written save of the same shards does: take the same state (Lightning's ``dump_checkpoint``, as
  lit-dist's save does) and ``torch.save`` the rank's local shards to the same disk (target >= 0.8x); also vs the
  same ``torch.save`` followed by ``fsync`` (on disk, as a checkpoint's files must be: the bare one may end with
  its bytes still in the page cache), and vs the ``torch.save`` alone (``throughput_ratio_write_only``: the state
  already taken). ``durable_ceiling``: the fsynced ``torch.save`` against the bare one, the most any save that is
  on disk when it returns can reach against the bare one on this disk. The ranks write at the same time; each kind's time is the slower rank's (a save is complete
  when every rank's part is).

Saves alternate (sync, async, bare, bare + fsync) every ``--every`` steps of the same run, so all three see the same state
size, page cache and disk; each starts after ``os.sync()`` and writes new files (nothing is deleted until the
end: about 9 GB on disk for the full run). Medians of ``--repeats`` saves of each kind, after one of each that
is not counted (``first_save_s``): the first asynchronous save allocates the buffers every later one copies into,
the first synchronous one plans what DCP caches.

    .venv/bin/python -m benchmarks.bench_sharded_checkpoint [--repeats 4] [--every 12] [--dir PATH] [--short]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

from benchmarks.common import SHORT_HELP, InMemoryData, TimedSaves, machine, result_line
from benchmarks.models import MLPClassifier
from lit_dist.callbacks.checkpoint import Checkpointing
from lit_dist.ckpt.store import STATE
from lit_dist.model.module import LitModel
from lit_dist.runtime import compat
from lit_dist.runtime.distributed import all_gather_object
from lit_dist.strategies.fsdp import FSDP2Strategy

KINDS = ("sync", "async", "bare", "bare_fsync")


class Measure(TimedSaves):
    """Every ``every`` steps, one save of the next kind in ``KINDS`` on every rank; records its times."""

    def __init__(self, checkpointing: Checkpointing, folder: str, every: int, repeats: int):
        super().__init__(list(KINDS) * (repeats + 1), every)  # the first round warms up
        self.checkpointing, self.folder = checkpointing, folder
        self.times = {kind: [] for kind in KINDS}
        self.write_s = {kind: [] for kind in KINDS if kind.startswith("bare")}  # the torch.save alone
        self.bytes = {}
        self.results = None

    def save(self, trainer, kind: str) -> None:
        cb, rank = self.checkpointing, trainer.global_rank
        if kind.startswith("bare"):
            cb.wait_for_save(trainer)  # a previous asynchronous write must not overlap the baseline
        os.sync()  # what earlier saves left for the kernel to write back would slow down this one
        trainer.strategy.barrier()
        start = time.perf_counter()
        if kind.startswith("bare"):
            checkpoint = compat.dump_checkpoint(trainer)
            shards = {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]}
            shards = apply_to_collection(shards, DTensor, lambda t: t.to_local())
            # A new file each time, kept to the end, as each checkpoint's are: rewriting a file just deleted reuses
            # its blocks and ran twice as fast here, which no checkpoint gets.
            path = os.path.join(self.folder, f"bare-step{trainer.global_step}-rank{rank}.pt")
            taken = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(shards, f)
                if kind == "bare_fsync":  # on disk, as a checkpoint's files are before its marker
                    f.flush()
                    os.fsync(f.fileno())
            self.times[kind].append(time.perf_counter() - start)
            self.write_s[kind].append(time.perf_counter() - taken)
            self.bytes[kind] = os.path.getsize(path)
        else:
            cb.saver(trainer).async_save = kind == "async"  # the writer's own switch: it is made once per run
            saved = cb.save(trainer, "benchmark")  # for async: waits for the previous write first, counted as stall
            self.times[kind].append(time.perf_counter() - start)
            if kind == "sync":
                self.bytes[kind] = os.path.getsize(os.path.join(saved, STATE, f"__{rank}_0.distcp"))
        trainer.strategy.barrier()

    def on_train_end(self, trainer, pl_module):
        self.checkpointing.wait_for_save(trainer)
        self.results = all_gather_object(trainer, (self.times, self.bytes, self.step_s, self.write_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--every", type=int, default=12, help="steps between two saves")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder on the repo's disk)")
    parser.add_argument("--width", type=int, default=2048, help="MLPClassifier's width (the state's size)")
    parser.add_argument("--depth", type=int, default=9, help="MLPClassifier's residual blocks")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # one save of each kind, each followed by steps without one
        args.repeats, args.every, args.width, args.depth = 1, 4, 256, 2
    # Lightning starts rank 1 by running this script again: both ranks must agree on the folder.
    if "LIT_DIST_BENCH_SHARDED_DIR" not in os.environ:
        os.environ["LIT_DIST_BENCH_SHARDED_DIR"] = tempfile.mkdtemp(prefix=".bench-sharded-", dir=args.dir or os.getcwd())
    root = os.environ["LIT_DIST_BENCH_SHARDED_DIR"]
    seed_everything(0)
    model = LitModel(MLPClassifier(width=args.width, depth=args.depth),
                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    # No rotation while measuring: deleting a checkpoint frees blocks the next save would reuse (see "bare").
    checkpointing = Checkpointing(dirpath=os.path.join(root, "ckpt"), every_n_epochs=None, save_last=False,
                                  keep_last_n=2 * (args.repeats + 1) + 2)
    measure = Measure(checkpointing, root, args.every, args.repeats)
    trainer = Trainer(accelerator="cpu", devices=args.devices, strategy=FSDP2Strategy(),
                      max_steps=args.every * (len(KINDS) * (args.repeats + 1) + 3), logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[measure, checkpointing], num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=root)
    trainer.fit(model, InMemoryData(num_samples=4096, batch_size_per_device=16))
    if not trainer.is_global_zero:
        return
    shutil.rmtree(root, ignore_errors=True)

    ranks = measure.results
    # Per save, the slower rank's time: training goes on, and a save is complete, only when every rank's part is.
    each = {kind: [max(times[kind][i] for times, *_ in ranks) for i in range(len(ranks[0][0][kind]))] for kind in KINDS}
    took = {kind: statistics.median(each[kind][1:]) for kind in KINDS}  # the first round warmed up
    stall = {kind: took[kind] for kind in ("sync", "async")}
    per_rank = {kind: statistics.mean(size["sync" if kind == "async" else kind] for _, size, *_ in ranks) / took[kind]
                for kind in ("sync", "bare", "bare_fsync")}  # bytes per second and rank
    wrote = statistics.median(max(r[3]["bare"][i] for r in ranks) for i in range(1, len(ranks[0][3]["bare"])))
    per_rank["bare_write"] = statistics.mean(size["bare"] for _, size, *_ in ranks) / wrote

    def ratio(baseline: str) -> float:
        return per_rank["sync"] / per_rank[baseline]

    state_mb = sum(size["sync"] for _, size, *_ in ranks) / 1e6
    result = {
        "state_mb": round(state_mb, 1), "ranks": len(ranks),
        "sync_stall_s": round(stall["sync"], 3), "async_stall_s": round(stall["async"], 3),
        "stall_ratio": round(stall["async"] / stall["sync"], 3),
        "first_save_s": {kind: round(each[kind][0], 3) for kind in KINDS},
        "sync_mb_per_s_per_rank": round(per_rank["sync"] / 1e6, 1),
        "bare_torch_save_mb_per_s_per_rank": round(per_rank["bare"] / 1e6, 1),
        "bare_fsync_torch_save_mb_per_s_per_rank": round(per_rank["bare_fsync"] / 1e6, 1),
        "throughput_ratio": round(ratio("bare"), 3),
        "throughput_ratio_vs_fsynced": round(ratio("bare_fsync"), 3),
        # What any save that is on disk when it returns can reach against the bare torch.save: its own fsync.
        "durable_ceiling": round(per_rank["bare_fsync"] / per_rank["bare"], 3),
        "bare_write_only_mb_per_s_per_rank": round(per_rank["bare_write"] / 1e6, 1),
        "throughput_ratio_write_only": round(ratio("bare_write"), 3),
        "step_s_while_async_write": round(statistics.median(ranks[0][2]["after_async"]), 4),
        "step_s_otherwise": round(statistics.median(ranks[0][2]["after_other"]), 4),
        "all_times_s": [{k: [round(t, 3) for t in v] for k, v in times.items()} for times, *_ in ranks],
        "machine": machine(),
    }
    print(json.dumps(result, indent=1))
    print(f"async stall / sync stall = {result['stall_ratio']:.3f} (target <= 0.15); "
          f"sync sharded save / bare torch.save throughput per rank = {result['throughput_ratio']:.2f} (target >= 0.8)")
    met = result["stall_ratio"] <= 0.15 and result["throughput_ratio"] >= 0.8
    result_line("sharded_checkpoint", result["stall_ratio"], "<= 0.15", met,
                throughput_ratio=result["throughput_ratio"], throughput_target=">= 0.8",
                throughput_ratio_vs_fsynced=result["throughput_ratio_vs_fsynced"],
                durable_ceiling=result["durable_ceiling"],
                throughput_ratio_write_only=result["throughput_ratio_write_only"],
                **{k: result[k] for k in ("state_mb", "sync_stall_s", "async_stall_s")}, short=args.short)


if __name__ == "__main__":
    main()
