"""How a ``BucketDataModule`` uses its cache: what it needs from it, and the lookups its loaders get.

``plan_for`` turns the data module's datasets (all rows: train, val, test and predict read the
same cache) into a ``CachePlan``; ``open_views`` builds what is missing (mode build), checks that
nothing is (mode read), or sets up filling while training (mode ondemand), and returns the
per-dataset lookups the loader workers read.
"""

from dataclasses import dataclass

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_dist.errors import DataError


@dataclass
class Opened:
    """What a data module keeps of its cache: lookups per dataset, and in mode ondemand what fills it."""

    views: list[dict]
    filler: object = None  # OnDemandFill, while entries are missing
    fill_keys: list | None = None  # FillKeys per dataset, for the loader workers
    captions: object = None  # captions.Captions of a multi-field caption encoder: the batches' layout, the empty caption


def plan_for(data, parts: list):
    """The CachePlan of ``data`` (a BucketDataModule) read into ``parts``: every row, keyed for each cached field."""
    from lit_dist.cache.keys import listed_identity, mask_sources, sample_ids
    from lit_dist.cache.plan import CachePlan, DatasetNeed

    needs = []
    for source, (meta, buckets, _) in zip(data.sources, parts, strict=True):
        identity = meta.identity
        if identity is None:  # a table without bytes/mtime columns: one listing of the image root
            identity = listed_identity(source.image_root, meta.filenames, data.storage_options)
        captions = meta.extra.get("caption")
        if data.cache.caption_encoder is not None and captions is None:
            raise DataError(f"data.cache.caption_encoder needs a caption column, and {source.table_path} has none "
                            "(or data.extra_columns leaves it out)")
        images = data._dataset(source, meta, np.arange(len(meta)), buckets, random_crop=False)
        masked = data.cache.encoder is not None and any(s.masked for s in data.sources)  # a mask field: every row
        needs.append(DatasetNeed(
            images=images, sizes=data.bucket_sizes[buckets], samples=sample_ids(meta.filenames, source.image_root),
            identity=identity, captions=captions, root_field=data.root_field(len(needs)),
            tag_orders=source.tag_orders, keep_tokens=source.keep_tokens, masks=images.masks,
            mask_identity=mask_sources(identity, images.masks, source.image_root, data.storage_options) if masked
            else None,
        ))
    buckets = {"resolution": data.resolution, "alignment": data.alignment, "max_aspect": data.max_aspect}
    return CachePlan(data.cache, needs, buckets, *data.normalisation, storage_options=data.storage_options)


def build_for(data, device: torch.device, verify: bool = False, parts: list | None = None):
    """Build what the cache of ``data`` lacks, on every rank (a collective: every rank must call it)."""
    from lit_dist.cache.build import build

    plan = plan_for(data, parts if parts is not None else data.read())
    return plan, build(plan, device, data.num_workers, data.batch_size_per_device, verify=verify,
                       worker_start=data.worker_start)


def open_views(data, parts: list, device: torch.device) -> Opened:
    """The cache's entries for every dataset of ``data``, as its mode says."""
    cache = data.cache
    if cache.mode == "ondemand":
        return _fill(plan_for(data, parts), device)
    if cache.mode == "build":
        plan, _ = build_for(data, device, parts=parts)
    else:
        plan = plan_for(data, parts)
        if not plan.store.check():
            raise DataError(f"data.cache.dir = {cache.dir!r} holds no cache (data.cache.mode: read). Build it first: "
                            "`lit-dist cache --config <this config>`, or set data.cache.mode: build.")
    found, coverage = plan.match()
    incomplete = [c for c in coverage.values() if c.missing]
    if incomplete:
        details = []
        for c in incomplete:
            other = plan.describe_other(c.field, c.other_configs)
            details.append(c.summary() + (f"; {other}" if other else ""))
        raise DataError(f"data.cache.dir = {cache.dir!r} is incomplete for this run: {'; '.join(details)}. Build what "
                        "is missing with `lit-dist cache --config <this config>` (every rank of a job builds its "
                        "share), or set data.cache.mode: build.")
    if cache.mode == "read":  # a build read them already; after the coverage, whose stale entries say more
        plan.read_captions()
    rank_zero_info("lit-dist: reading " + "; ".join(c.summary() for c in coverage.values()) + f" from the cache {cache.dir}")
    return Opened(plan.views(found), captions=plan.captions)


def _fill(plan, device: torch.device) -> Opened:
    """Mode ondemand: read what the cache has; what it lacks is made while training (see ondemand.py)."""
    from lit_dist.cache.build import _drop_damaged, check_encoder, check_sources, prepare
    from lit_dist.cache.ondemand import FillKeys, OnDemandFill
    from lit_dist.runtime.distributed import Comm

    comm = Comm.current()
    prepare(plan, comm)
    _drop_damaged(plan, comm, verify=False)  # their samples are made again while training
    check_encoder(plan, device)
    found, coverage = plan.match()
    check_sources(plan, found, comm)  # what is missing is decoded while training: are its images there?
    views = plan.views(found)
    rank_zero_info("lit-dist: " + "; ".join(c.summary() for c in coverage.values())
                   + f" in {plan.config.dir}; what is missing is cached while training (mode ondemand)")
    if not any(c.missing for c in coverage.values()):
        return Opened(views)
    keys = [FillKeys(need.samples, {plan.batch_key(f): need.keys[f] for f in plan.fields}) for need in plan.needs]
    return Opened(views, OnDemandFill(plan, views), keys)
