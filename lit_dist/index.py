"""``lit-dist index ROOT --output meta.parquet``: preprocess an image folder into a metadata table once."""

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
        workers: Parallel header readers; default: one process per core locally, 32 threads remotely.
        storage_options: fsspec options for root (e.g. {"endpoint_url": ...}); credentials come from env vars.
    """
    import fsspec
    import pyarrow.parquet as pq

    from lit_dist.data.discovery import scan_folder, write_table_atomically

    started = time.perf_counter()
    fs, path = fsspec.core.url_to_fs(output)
    previous = pq.read_table(path, filesystem=fs) if fs.exists(path) else None
    if previous is not None and not {"bytes", "mtime"} <= set(previous.column_names):
        previous = None  # not an index written by lit-dist: rescan everything
    table = scan_folder(root, storage_options, labels_from_folders, workers, previous)
    write_table_atomically(table, output)
    elapsed = time.perf_counter() - started
    unreadable = int((table.column("width").to_numpy() == 0).sum())
    print(f"lit-dist index: {table.num_rows} images under {root} -> {output} in {elapsed:.1f} s "
          f"({table.num_rows / max(elapsed, 1e-9):.0f} images/s); {unreadable} unreadable (kept with size 0, "
          "reported as bad rows when training)")
