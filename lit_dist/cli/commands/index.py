"""``lit-dist index ROOT --output meta.parquet``: preprocess an image folder into a metadata table once.

    lit-dist index /datasets/photos --output photos.parquet
    torchrun --nproc-per-node 8 -m lit_dist index /datasets/photos --output photos.parquet
    srun --ntasks-per-node 8 lit-dist index s3://bucket/photos --output photos.parquet
"""

import time


def index(
    root: str,
    output: str = "metadata.parquet",
    labels_from_folders: bool = False,
    workers: int | None = None,
    storage_options: dict | None = None,
) -> None:
    """Index a folder of images into a parquet metadata table, reading image headers only.

    Args:
        root: Folder of images, a local path or an fsspec URL (s3://bucket/images/).
        output: Parquet file to write, local path or URL; rerunning reuses its rows for unchanged files.
        labels_from_folders: Take each image's label from its first folder level under root.
        workers: Parallel header readers per process; default: this node's cores shared among its processes
            locally, 32 threads remotely.
        storage_options: fsspec options for root (e.g. {"endpoint_url": ...}); credentials come from env vars.
    """
    from lit_dist.data.discovery import read_previous_index, scan_folder, write_table_atomically
    from lit_dist.runtime.distributed import launched_group

    started = time.perf_counter()
    # Started as several processes (srun, torchrun): each reads a share of the headers, rank 0 writes.
    with launched_group() as comm:
        previous = read_previous_index(output) if comm.rank == 0 else None  # rows of unchanged files are reused
        table = scan_folder(root, storage_options, labels_from_folders, workers, previous, comm=comm)
        comm.on_rank_zero(lambda: write_table_atomically(table, output), f"writing {output}")
    if comm.rank != 0:
        return
    elapsed = time.perf_counter() - started
    unreadable = int((table.column("width").to_numpy() == 0).sum())
    processes = f" by {comm.world} processes" if comm.world > 1 else ""
    print(f"lit-dist index: {table.num_rows} images under {root} -> {output} in {elapsed:.1f} s{processes} "
          f"({table.num_rows / max(elapsed, 1e-9):.0f} images/s); {unreadable} unreadable (kept with size 0, "
          "reported as bad rows when training)")
