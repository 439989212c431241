"""Writing what ``lit-dist predict`` returns: one parquet file per rank in the run directory."""

import os

import torch


def write_predictions(batches: list, run_path: str, rank: int) -> str | None:
    """Concatenate per-batch dicts of tensors into ``predictions-rank{rank}.parquet``; returns its path.

    Each rank writes its own file (no collective needed); read them all with
    ``pyarrow.parquet.read_table(run_path)`` or pandas.
    """
    batches = [b for b in batches if isinstance(b, dict)]
    if not batches:
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        if all(isinstance(v, torch.Tensor) for v in values):
            columns[key] = torch.cat([v.detach().cpu().reshape(len(v), -1).squeeze(1) for v in values]).numpy()
    os.makedirs(run_path, exist_ok=True)
    path = os.path.join(run_path, f"predictions-rank{rank}.parquet")
    pq.write_table(pa.table(columns), path)
    return path
