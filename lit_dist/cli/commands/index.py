"""``lit-dist index``: preprocess a dataset's headers into an index once, before any run.

    lit-dist index /datasets/photos --output photos.parquet               # a folder of images -> a metadata table
    torchrun --nproc-per-node 8 -m lit_dist index /datasets/photos --output photos.parquet
    srun --ntasks-per-node 8 lit-dist index s3://bucket/photos --output photos.parquet
    srun lit-dist index --webdataset 's3://bucket/laion/{00000..09999}.tar' --output laion.parquet
    lit-dist index --hf_dataset /datasets/pokemon --output pokemon.parquet

The index of tar shards or of a Hugging Face dataset is the one a run makes at its start: name it as the run's
``data.index_cache`` and the run uses it as it is (it is made anew only where the files changed).
"""

import time


def index(
    root: str | None = None,
    output: str = "metadata.parquet",
    labels_from_folders: bool = False,
    workers: int | None = None,
    storage_options: dict | None = None,
    webdataset: str | list[str] | None = None,
    hf_dataset: str | None = None,
    image_column: str = "image",
    caption_column: str | None = None,
    label_column: str | None = None,
) -> None:
    """Index a dataset once from image headers: a folder into a metadata table, shards or a HF dataset into an index.

    The index of tar shards or of a Hugging Face dataset is the one a run makes: name it as its data.index_cache.

    Args:
        root: Folder of images, a local path or an fsspec URL (s3://bucket/images/).
        output: Parquet file to write, local path or URL; rerunning reuses its rows for unchanged files.
        labels_from_folders: With root: take each image's label from its first folder level under root.
        workers: With root: parallel header readers per process; default: this node's cores shared among its
            processes locally, 32 threads remotely.
        storage_options: fsspec options (e.g. {"endpoint_url": ...}); credentials come from env vars.
        webdataset: Instead of root: WebDataset tar shards, a brace pattern or a list (local or URLs).
        hf_dataset: Instead of root: a Hugging Face dataset (a save_to_disk folder, parquet files or a hub id).
        image_column: With hf_dataset: the column of the images.
        caption_column: With hf_dataset: the column of the captions; default caption, text or prompt if present.
        label_column: With hf_dataset: the column of the labels; default label if present.
    """
    from lit_dist.errors import ConfigError
    from lit_dist.runtime.distributed import launched_group

    given = [name for name, value in (("root", root), ("--webdataset", webdataset), ("--hf_dataset", hf_dataset))
             if value is not None]
    if len(given) != 1:
        raise ConfigError("lit-dist index takes one dataset: a folder (lit-dist index ROOT), --webdataset PATTERN or "
                          f"--hf_dataset PATH; {'none was' if not given else ' and '.join(given) + ' were'} given")
    started = time.perf_counter()
    # Started as several processes (srun, torchrun): each reads a share of the headers, rank 0 writes.
    with launched_group() as comm:
        if root is not None:
            table, what = _scan(root, output, labels_from_folders, workers, storage_options, comm), f"images under {root}"
        else:
            table, what = _containers(webdataset, hf_dataset, output, storage_options, comm,
                                      (image_column, caption_column, label_column))
    if comm.rank != 0:
        return
    elapsed = time.perf_counter() - started
    unreadable = int((table.column("width").to_numpy() == 0).sum())
    processes = f" by {comm.world} processes" if comm.world > 1 else ""
    print(f"lit-dist index: {table.num_rows} {what} -> {output} in {elapsed:.1f} s{processes} "
          f"({table.num_rows / max(elapsed, 1e-9):.0f} images/s); {unreadable} unreadable (kept with size 0, "
          "reported as bad rows when training)")


def _scan(root, output, labels_from_folders, workers, storage_options, comm):
    from lit_dist.data.discovery import read_previous_index, scan_folder, write_table_atomically

    previous = read_previous_index(output) if comm.rank == 0 else None  # rows of unchanged files are reused
    table = scan_folder(root, storage_options, labels_from_folders, workers, previous, comm=comm)
    comm.on_rank_zero(lambda: write_table_atomically(table, output), f"writing {output}")
    return table


def _containers(webdataset, hf_dataset, output, storage_options, comm, columns):
    """The index of tar shards or of a Hugging Face dataset, made (or found up to date) at ``output``, and what it
    indexed, for the summary line."""
    import pyarrow.parquet as pq

    from lit_dist.data import hf_dataset as hf
    from lit_dist.data import webdataset as wds
    from lit_dist.runtime import outage

    if webdataset is not None:
        wds.load_or_index(webdataset, output, storage_options, comm)
        shards = webdataset if isinstance(webdataset, str) else ", ".join(webdataset)
        what = f"samples of the tar shards {shards}"
    else:
        hf.load_or_index(hf_dataset, hf.Columns(*columns), output, storage_options, comm)
        what = f"examples of the Hugging Face dataset {hf_dataset}"
    if comm.rank != 0:
        return None, what
    fs, path = outage.url_to_fs(output)
    with fs.open(path, "rb") as f:
        return pq.read_table(f, columns=["width"]), what
