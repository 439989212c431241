"""``lit-dist plan --config cfg.yaml``: what a run would do, checked before any GPU or process group.

Prints the world size, batch sizes, learning rate, warmup, steps and a table of
buckets, then every problem found. Exits 0 when the run can start, else with the
exit code of the first kind of problem (configuration 2, data 3).
"""

import math
import os
from typing import TYPE_CHECKING

from lit_dist.errors import ExitCode, LitDistError
from lit_dist.runtime.launch import world_size

if TYPE_CHECKING:  # typed, so that building the command's parser reads no stubs (a subprocess of jsonargparse's)
    from lit_dist.cli.app import RunConfigCLI


def plan(cli: "RunConfigCLI") -> int:
    """Print what a run would do (world size, batches, learning rate, warmup, steps, buckets, cache) and every
    problem found, without a GPU or a process group; exit 0 when the run can start, else 2 (configuration)
    or 3 (data).

    Args:
        cli: The run config, given as for fit: --config FILE and dotted overrides.
    """
    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.model.module import LitModel, lr_scale_factor

    config = cli.config
    model, data = cli.model, cli.datamodule
    trainer = config.trainer
    world, per_node, nodes = world_size(trainer)
    accumulate = int(trainer.accumulate_grad_batches or 1)
    lines = [f"world size          {world} ({per_node} devices x {nodes} nodes)"]
    problems: list[tuple[ExitCode, str]] = []

    per_device = getattr(data, "batch_size_per_device", None)
    effective = per_device * world * accumulate if per_device else None
    if per_device:
        lines.append(f"batch               {per_device} per device, global {per_device * world}, "
                     f"effective {effective} (x{accumulate} accumulation)")
    if isinstance(model, LitModel):
        import torch

        from lit_dist.model.optimizers import notes, refusals, sets_its_own_step

        optimizer = model.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
        lr = optimizer.param_groups[0]["lr"]
        if sets_its_own_step(optimizer):
            lines.append(f"learning rate       {lr:.4g} ({type(optimizer).__name__} estimates its own step size: "
                         "not scaled)")
        elif effective is not None:
            scaled = lr * lr_scale_factor(model.lr_scaling, effective, model.base_batch_size)
            lines.append(f"learning rate       {lr:.4g} -> {scaled:.4g} ({model.lr_scaling} scaling against base "
                         f"batch {model.base_batch_size})")
        elif model.lr_scaling != "none":
            problems.append((ExitCode.CONFIG_ERROR, f"model.lr_scaling = {model.lr_scaling!r} needs a data module "
                                                    "with batch_size_per_device"))
        lines.append(f"warmup              {model.warmup_steps} optimizer steps")
        lines += [f"note                {note}" for note in notes(optimizer, model.lr_scaling, model.warmup_steps,
                                                                model.lr_decay, model.lr_scheduler_factory is not None)]
        # DeepSpeed's refusal came before this, from the strategy's checks.
        problems += [(ExitCode.CONFIG_ERROR, line) for line in refusals(optimizer, "other", model.ema is not None)]

    if isinstance(data, BucketDataModule):
        problems += _plan_data(data, world, accumulate, trainer, lines)
    else:
        lines.append(f"data                {type(data).__name__}: not a BucketDataModule, no bucket plan")

    print("lit-dist plan\n" + "\n".join(f"  {line}" for line in lines))
    if problems:
        print("problems:\n" + "\n".join(f"  - {text}" for _, text in problems))
        return int(min(code for code, _ in problems))
    print("no problems found")
    return int(ExitCode.OK)


def _plan_data(data, world: int, accumulate: int, trainer, lines: list[str],
               shown: str | None = None) -> list[tuple[ExitCode, str]]:
    import numpy as np

    from lit_dist.data.demo.shapes import is_demo_place

    if data.create_demo_if_missing and data.metadata and not os.path.exists(data.metadata) and is_demo_place(data.metadata):
        return _plan_demo(data, world, accumulate, trainer, lines)
    try:
        data.prepare_data()  # indexes scanned folders (headers only) or reuses their cached index
        parts = data.read()
    except LitDistError as err:
        return [(err.exit_code, str(err))]
    k = len(data.bucket_sizes)
    for i, (source, (meta, _, splits)) in enumerate(zip(data.sources, parts, strict=True)):
        counts = [int((splits == code).sum()) for code in range(3)]
        name = f"dataset {i} " if len(parts) > 1 else "data        "
        weight = f", weight {source.weight:g}" if len(parts) > 1 else ""
        lines.append(f"{name}        {len(meta)} usable rows of {shown or source.described}: {counts[0]} train, {counts[1]} val, "
                     f"{counts[2]} test; {meta.bad.total} bad rows skipped{weight}")
        if meta.bad.total:
            lines.append(f"bad rows            {meta.bad.summary()}")
    train_groups = np.concatenate([buckets[splits == 0].astype(np.int64) + i * k
                                   for i, (_, buckets, splits) in enumerate(parts)])
    _, _, rows, bucket_problems = data.plan_train(train_groups, world)
    batches = sum(r["batches_per_rank"] for r in rows)
    steps = math.ceil(batches / accumulate)
    total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else steps * (trainer.max_epochs or 1000)
    lines.append(f"steps per epoch     {steps} optimizer steps ({batches} batches per rank); run: {total} steps")
    lines.append("buckets (train)     " + ("dataset  " if len(parts) > 1 else "")
                 + "width x height   samples   repeats   batches/rank   left for next epoch")
    for r in rows:
        w, h = r["bucket"]
        dataset = f"{r['dataset']:>7}  " if len(parts) > 1 else ""
        lines.append(f"                    {dataset}{w:>5} x {h:<6}  {r['samples']:>9}   {r['repeats']:>7}   "
                     f"{r['batches_per_rank']:>12}   {r['left_for_next_epoch']:>19}")
    problems = [(ExitCode.DATA_ERROR, p) for p in bucket_problems]
    if batches == 0 and not problems:
        problems.append((ExitCode.DATA_ERROR, "an epoch would have zero training batches"))
    if data.cache is not None:
        try:
            problems += _plan_cache(data, parts, lines)
        except LitDistError as err:
            problems.append((err.exit_code, str(err)))
    return problems


def _plan_demo(data, world: int, accumulate: int, trainer, lines: list[str]) -> list[tuple[ExitCode, str]]:
    """The plan of the demo dataset before it is generated: from its table, which is made without drawing
    an image, so the verdict is the same before and after the first run."""
    import copy
    import dataclasses
    import tempfile

    import pyarrow.parquet as pq

    from lit_dist.data.demo.shapes import demo_table

    lines.append(f"demo                not generated yet: {data.demo_num_images} images at {data.metadata} on first use "
                 "(planned from their table)")
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "metadata.parquet")
        pq.write_table(demo_table(data.demo_num_images, data.seed), table)
        planned = copy.copy(data)  # the same module, reading the table in tmp
        planned.create_demo_if_missing = False
        planned.sources = [dataclasses.replace(data.sources[0], metadata=table, root=os.path.dirname(data.metadata))]
        return _plan_data(planned, world, accumulate, trainer, lines, shown=data.metadata)


def _plan_cache(data, parts: list, lines: list[str]) -> list[tuple[ExitCode, str]]:
    """The cache's coverage of this run, its size and compression; a problem when mode read would fail."""
    cache = data.cache
    plan = data.cache_plan(parts)
    if not plan.store.check():
        lines.append(f"cache               none yet at {cache.dir} (mode {cache.mode}); `lit-dist cache --config ...` "
                     "builds it on every rank")
        return [(ExitCode.DATA_ERROR, f"data.cache.mode is read and {cache.dir} holds no cache")] if cache.mode == "read" else []
    _, coverage = plan.match()
    lines.append(f"cache               {cache.dir} (mode {cache.mode}, {cache.compression})")
    problems = []
    for name, c in coverage.items():
        lines.append(f"                    {c.summary()}; {plan.store.size_summary(name)}")
        if c.missing and cache.mode == "read":
            problems.append((ExitCode.DATA_ERROR, f"data.cache.mode is read and {c.field} lacks {c.missing} entries: "
                                                  "run `lit-dist cache --config <this config>` first"))
    return problems
