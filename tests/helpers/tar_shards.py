"""The demo shapes as WebDataset tar shards, written as img2dataset and webdataset's writer write them: per sample
``<key>.png``, ``<key>.txt`` (the caption) and ``<key>.cls`` (the label's index among the sorted names); with
``json``, also ``<key>.json`` as img2dataset writes it (its url, caption, similarity and original size)."""

import io
import json as json_
import os
import tarfile


def save_shapes(table: str, folder, per_shard: int = 100, json: bool = False, txt: bool = True) -> list[str]:
    """The rows of the shapes ``table``, in order, as ``folder/00000.tar``, ...; returns the shards' paths.
    ``txt``: False leaves the caption to the json member alone."""
    import pyarrow.parquet as pq

    rows = pq.read_table(table).to_pylist()
    classes = sorted({r["label"] for r in rows})  # names, or already indices
    root = os.path.dirname(table)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for start in range(0, len(rows), per_shard):
        path = os.path.join(str(folder), f"{start // per_shard:05d}.tar")
        with tarfile.open(path, "w") as tar:
            for i, r in enumerate(rows[start : start + per_shard], start):
                with open(os.path.join(root, r["filename"]), "rb") as f:
                    image = f.read()
                key = f"sample{i:06d}"
                members = [("png", image), ("txt", r["caption"].encode()) if txt else None,
                           ("cls", str(classes.index(r["label"])).encode())]
                if json:
                    fields = {"url": f"https://example.com/{key}.png", "key": key, "caption": r["caption"],
                              "similarity": round(0.2 + (i % 7) / 20, 2), "original_width": r["width"],
                              "original_height": r["height"], "status": "success", "exif": None}
                    members.append(("json", json_.dumps(fields).encode()))
                for extension, data in filter(None, members):
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths
