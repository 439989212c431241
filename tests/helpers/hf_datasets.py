"""The demo shapes as a Hugging Face dataset folder, written by ``datasets`` itself (``save_to_disk``), as a user
has one: the images' bytes in an ``Image`` column, captions and labels beside them."""

import os


def save_shapes(table: str, folder, splits: bool = True, caption: str = "caption", rows_per_file: int | None = None):
    """The rows of the shapes ``table`` as a dataset at ``folder``: a DatasetDict of train and validation (the
    table's split column) or, with ``splits`` false, one Dataset of every row. ``caption`` names the caption
    column; ``rows_per_file`` splits each split into several Arrow files. Returns ``folder``."""
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict, Features, Image, Value

    rows = pq.read_table(table).to_pylist()
    root = os.path.dirname(table)
    labels = "int64" if isinstance(rows[0]["label"], int) else "string"
    features = Features({"image": Image(), caption: Value("string"), "label": Value(labels)})

    def part(chosen: list[dict]) -> Dataset:
        images = []
        for r in chosen:
            with open(os.path.join(root, r["filename"]), "rb") as f:
                images.append({"bytes": f.read(), "path": None})
        return Dataset.from_dict({"image": images, caption: [r["caption"] for r in chosen],
                                  "label": [r["label"] for r in chosen]}, features=features)

    shards = {}
    if splits:
        parts = {"train": part([r for r in rows if r["split"] == "train"]),
                 "validation": part([r for r in rows if r["split"] == "val"])}
        dataset = DatasetDict(parts)
        if rows_per_file is not None:
            shards = {"num_shards": {name: max(1, -(-len(p) // rows_per_file)) for name, p in parts.items()}}
    else:
        dataset = part(rows)
        if rows_per_file is not None:
            shards = {"num_shards": max(1, -(-len(rows) // rows_per_file))}
    dataset.save_to_disk(str(folder), **shards)
    return folder
