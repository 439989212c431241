"""Aspect-ratio-bucketed image data: metadata, buckets, sampler, dataset, data module."""
