"""Preprocessed caches: resized pixels and frozen-encoder outputs, built once and read instead of decoding.

    config.py     CacheConfig: the ``data.cache`` section of a run config
    keys.py       what identifies an entry: source, transform, encoder identity and weights, dtype
    shards.py     Arrow IPC shard files of many samples, one record batch each, read one range at a time
    store.py      a cache folder: marker, per-field manifests, pending lists of unfinished builds, cleaning
    encoders.py   the frozen encoder named in the config, its identity, and the VAE adapter
    build.py      every rank builds its share of what is missing; rank 0 publishes
    reader.py     per-sample lookups for the loader workers

The ``lit-dist cache`` command (build, ``--check``) is ``lit_dist/cli/commands/cache.py``.
"""
