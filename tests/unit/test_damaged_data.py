"""Damaged, truncated, emptied or deleted files of a dataset or a cache, and a wrong data root: each ends in one
message and a documented exit code, or a documented recovery; never a traceback, never a silent wrong result.

Every file here was written by a real run (``lit-dist cache``, ``lit-dist index``, or the build's own code for
the pending list of a build that was cut off), then garbled, and the real command line is run on it.
"""

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import lit_dist, quickstart_args

FIT = dict(trainer__max_steps=1, trainer__limit_val_batches=0, data__num_workers=0, data__allow_oversubscription=True)
READ = dict(FIT, data__cache__mode="read")  # train from a cache built before, refusing an incomplete one


def garble(path: Path, how: str) -> None:
    """Damage a file as a full disk, a killed copy or a careless ``rm`` does."""
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


def one_error(out) -> str:
    """The one "lit-dist: error:" line a failed command printed (and no traceback)."""
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("lit-dist: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def trained(out) -> bool:
    return "checkpoint at step 1" in out.stdout + out.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory, demo_data):
    """A pixel cache of the demo data built by `lit-dist cache`, a table written by `lit-dist index`, and the
    cache of a build cut off after it listed some shards in its pending list (not yet published)."""
    from lit_dist.cache.build import _run, _work, prepare
    from lit_dist.runtime.distributed import Comm
    from tests.helpers.cache import data_module

    root = tmp_path_factory.mktemp("built")
    out = lit_dist("cache", *quickstart_args(None, demo_data, data__cache__dir=root / "cache",
                                             data__allow_oversubscription=True))
    assert out.returncode == 0, out.stderr[-3000:]
    out = lit_dist("index", str(demo_data.parent), "--output", str(root / "index.parquet"), "--labels_from_folders",
                   "true")
    assert out.returncode == 0, out.stderr[-3000:]
    # The quickstart's data settings, so that its keys are the command line's.
    from lit_dist.cache.config import CacheConfig

    dm = data_module(demo_data, CacheConfig(dir=str(root / "cut"), shard_size_mb=1), seed=0, batch_size_per_device=32)
    plan = dm.cache_plan(dm.read())
    prepare(plan, Comm())
    found, _ = plan.match()
    work = _work(plan, found, 8)[:10]
    _run(plan, work, torch.device("cpu"), 0, {"samples": 0, "unreadable": 0, "bytes": 0, "raw_bytes": 0, "shards": 0},
         rank=0, progress=False)
    assert list((root / "cut" / "pixels" / "pending").glob("*.json"))
    return root, sum(len(rows) for _, rows, _ in work)


def shard_file(cache: Path, suffix: str) -> Path:
    return next(p for p in (cache / "pixels" / "shards").iterdir() if p.name.endswith(suffix)
                and (suffix == ".index.arrow" or not p.name.endswith(".index.arrow")))


# (file, the command run on it, what each damage gives: exit code and a pattern of its message)
CASES = {
    "CACHE.json": ("fit", {"truncate": (0, r"CACHE.json is damaged .*read as a cache"),
                           "empty": (0, r"CACHE.json is damaged .*read as a cache"),
                           "delete": (0, r"CACHE.json is missing, but the folder holds a lit-dist cache")}),
    "manifest": ("fit", {how: (0, rf"manifest.json is {'missing' if how == 'delete' else 'damaged'}.*rebuilt from the "
                                  r"index files beside its shards.*\(1 shards, 400 samples\)")
                         for how in ("truncate", "empty", "delete")}),
    "configs.json": ("check", {how: (3, r"stale entries were built for another configuration: \w+ \(what differs is "
                                        r"unknown: pixels/configs.json does not describe it\)")
                               for how in ("truncate", "empty", "delete")}),
    "pending list": ("cache", {"truncate": (0, r"damaged list\(s\) of an interrupted build.*unlisted shards taken from "
                                               r"their index files"),
                               "empty": (0, r"damaged list\(s\) of an interrupted build.*unlisted shards taken from "
                                            r"their index files"),
                               "delete": (0, None)}),  # unlisted shards are never trusted: rebuilt
    "index file": ("fit", {"truncate": (3, r"incomplete.*shard \S+ its index file \d+ bytes, the manifest says"),
                           "empty": (3, r"incomplete.*shard \S+ its index file 0 bytes, the manifest says"),
                           "delete": (3, r"incomplete.*shard \S+ its index file missing \(400 samples\)")}),
    "shard": ("fit", {"truncate": (3, r"incomplete.*shard \S+ \d+ bytes, the manifest says \d+"),
                      "empty": (3, r"incomplete.*shard \S+ 0 bytes, the manifest says \d+"),
                      "delete": (3, r"incomplete.*shard \S+ missing \(400 samples\)")}),
    "scan index": ("scan", {"truncate": (0, r"cached index \S+ is damaged .*scanning the folder again"),
                            "empty": (0, r"cached index \S+ is damaged .*scanning the folder again"),
                            "delete": (0, None)}),
    "lit-dist index table": ("table", {"truncate": (3, r"is not a readable parquet file .*damaged"),
                                       "empty": (3, r"is not a readable parquet file .*damaged"),
                                       "delete": (3, r"no parquet file there")}),
}


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate", "empty", "delete"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_damaged_file_gives_one_message_and_its_exit_code_or_is_recovered(tmp_path, demo_data, built, name, how):
    source, done = built
    cache = tmp_path / "cache"
    shutil.copytree(source / ("cut" if name == "pending list" else "cache"), cache)
    shutil.copy(source / "index.parquet", tmp_path / "index.parquet")
    target = {"CACHE.json": cache / "CACHE.json", "manifest": cache / "pixels" / "manifest.json",
              "configs.json": cache / "pixels" / "configs.json",
              "index file": shard_file(cache, ".index.arrow"), "shard": shard_file(cache, ".arrow"),
              "scan index": tmp_path / "index.parquet", "lit-dist index table": tmp_path / "index.parquet"}.get(name)
    if name == "pending list":
        target = next((cache / "pixels" / "pending").glob("*.json"))
    garble(target, how)
    command, expected = CASES[name]
    code, pattern = expected[how]
    runs = tmp_path / "runs"
    if command == "fit":
        out = lit_dist("fit", *quickstart_args(runs, demo_data, data__cache__dir=cache, **READ))
    elif command == "check":  # the stale entries of another resolution name the configuration they were built for
        out = lit_dist("cache", *quickstart_args(None, demo_data, data__cache__dir=cache, data__resolution=40,
                                                 data__allow_oversubscription=True), "--check")
    elif command == "cache":
        out = lit_dist("cache", *quickstart_args(None, demo_data, data__cache__dir=cache,
                                                 data__allow_oversubscription=True))
    elif command == "scan":
        out = lit_dist("fit", *quickstart_args(runs, None, data__metadata=None, data__scan_root=demo_data.parent,
                                               data__labels_from_folders=True, data__index_cache=target,
                                               data__preserve_cache=True, **FIT))
    else:
        out = lit_dist("fit", *quickstart_args(runs, target, data__root=demo_data.parent, **FIT))
    text = out.stdout + out.stderr
    assert out.returncode == code, text[-3000:]
    if command == "check":  # a report, not an error: stale entries name what they were built for
        assert "Traceback" not in text and re.search(pattern, out.stdout), text[-3000:]
        damaged = [line for line in out.stderr.splitlines() if "configs.json is damaged" in line]
        assert len(damaged) == (how != "delete") and all(line.startswith("lit-dist: ") for line in damaged), text
    elif code:
        assert re.search(pattern, one_error(out)), one_error(out)
        assert not trained(out), "refused before training, not during it"
    else:
        assert "Traceback" not in text, text[-3000:]
        if pattern:
            lines = [line for line in text.splitlines() if re.search(pattern, line)]
            assert len(lines) == 1 and lines[0].startswith("lit-dist: "), text[-3000:]
    if command == "fit" and code == 0:
        assert trained(out), text[-3000:]
    if name == "pending list":  # a damaged list costs nothing: its shards describe themselves; a deleted one, a rebuild
        assert f"built {400 if how == 'delete' else 400 - done} samples" in out.stdout, text[-3000:]
    if name == "scan index":
        assert pq.read_table(target).num_rows == 400  # scanned again and written whole


@pytest.mark.process
def test_a_truncated_manifest_is_rebuilt_from_the_index_files_and_written_back(tmp_path, demo_data, built):
    cache = tmp_path / "cache"
    shutil.copytree(built[0] / "cache", cache)
    manifest = cache / "pixels" / "manifest.json"
    original = json.loads(manifest.read_text())
    garble(manifest, "truncate")
    args = quickstart_args(None, demo_data, data__cache__dir=cache, data__allow_oversubscription=True)
    out = lit_dist("cache", *args, "--check")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.search(r"^lit-dist: \S+/pixels/manifest.json is damaged \(Unterminated string.*\): rebuilt from the index "
                     r"files beside its shards, which describe them \(1 shards, 400 samples\); lit-dist cache writes it "
                     r"back$", out.stderr, re.M), out.stderr[-3000:]
    assert "pixels: 400 of 400 cached" in out.stdout
    out = lit_dist("cache", *args)
    assert out.returncode == 0 and "built 0 samples" in out.stdout, out.stderr[-3000:]
    assert "nothing to write" in out.stdout and "nan" not in out.stdout, out.stdout  # not "compression nanx"
    assert json.loads(manifest.read_text())["shards"] == original["shards"]  # the same entries, nothing rebuilt


@pytest.mark.process
def test_a_deleted_shard_stops_mode_read_before_training_and_is_rebuilt(tmp_path, demo_data, built):
    cache = tmp_path / "cache"
    shutil.copytree(built[0] / "cache", cache)
    shard = shard_file(cache, ".arrow")
    shard.unlink()
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", demo_data, data__cache__dir=cache,
                                           **{**READ, "data__num_workers": 1}))
    assert out.returncode == 3 and not trained(out), out.stderr[-3000:]
    assert re.search(rf"is incomplete for this run: pixels: 0 of 400 cached .* shard {shard.stem} missing \(400 samples\)"
                     r".*lit-dist cache --config", one_error(out))
    out = lit_dist("cache", *quickstart_args(None, demo_data, data__cache__dir=cache, data__allow_oversubscription=True))
    assert out.returncode == 0 and "built 400 samples" in out.stdout, out.stderr[-3000:]


def move_images_down(demo_data: Path, where: Path) -> Path:
    """The demo table, with its images one folder deeper (``images/``) than the table: a common wrong root."""
    for folder in ("circle", "cross", "square", "triangle"):
        shutil.copytree(demo_data.parent / folder, where / "images" / folder)
    shutil.copy(demo_data, where / "metadata.parquet")
    return where / "metadata.parquet"


@pytest.mark.process
def test_a_wrong_root_stops_before_training_and_says_where_the_files_are(tmp_path, demo_data):
    table = move_images_down(demo_data, tmp_path)
    args = dict(trainer__max_steps=1, trainer__limit_val_batches=0, data__allow_oversubscription=True)
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", table, **args))
    assert out.returncode == 3 and not trained(out), out.stderr[-3000:]
    assert one_error(out) == (
        f"lit-dist: error: data.root = '{tmp_path}' (unset: the folder of data.metadata): 32 of 32 files sampled from "
        f"the table are not there (e.g. {tmp_path}/circle/000000.png); they are in '{tmp_path}/images' (one folder "
        f"down): set data.root: {tmp_path}/images")
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", table, data__root=tmp_path / "images" / "circle", **args))
    assert out.returncode == 3, out.stderr[-3000:]
    assert f"they are in '{tmp_path}/images' (one folder up)" in one_error(out)
    # A cache build decodes them too: the same check before it starts.
    out = lit_dist("cache", *quickstart_args(None, table, data__cache__dir=tmp_path / "cache",
                                             data__allow_oversubscription=True))
    assert out.returncode == 3 and "32 of 32 files sampled from the table are not there" in one_error(out)


@pytest.mark.process
def test_a_bucket_of_bad_images_is_one_data_error_from_a_loader_worker(tmp_path, demo_data):
    shutil.copytree(demo_data.parent, tmp_path / "shapes")
    for image in (tmp_path / "shapes").glob("*/*.png"):
        garble(image, "truncate")  # every image cut in half: a copy that was interrupted
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", tmp_path / "shapes" / "metadata.parquet",
                                           trainer__max_steps=1, data__num_workers=1,
                                           data__allow_oversubscription=True))
    assert out.returncode == 3 and not trained(out), out.stderr[-3000:]
    line = one_error(out)
    match = re.fullmatch(r"lit-dist: error: (\d) samples in a row of bucket \d+x\d+ could not be read, under (\S+): "
                         r"((?:\w+/\d+\.png, )*\w+/\d+\.png) \(the last: image file is truncated\)\. .*", line)
    assert match and match.group(2) == str(tmp_path / "shapes"), line
    assert len(set(match.group(3).split(", "))) == int(match.group(1)) > 1, line
    # The files named are the ones tried: each was logged as replaced before the batch gave up.
    for name in match.group(3).split(", "):
        assert f"cannot read {tmp_path}/shapes/{name} (" in out.stderr


@pytest.mark.process
def test_a_bucket_of_damaged_cache_entries_is_one_data_error_from_the_reading_threads(tmp_path, demo_data, built):
    cache = tmp_path / "cache"
    shutil.copytree(built[0] / "cache", cache)
    shard = shard_file(cache, ".arrow")
    data = bytearray(shard.read_bytes())
    data[200:] = bytes(len(data) - 200)  # zeroed after the schema, same size: only the entries' crc32s tell
    shard.write_bytes(bytes(data))
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", demo_data, data__cache__dir=cache,
                                           **{**READ, "data__num_workers": 2}))
    assert out.returncode == 3 and not trained(out), out.stderr[-3000:]
    assert re.fullmatch(r"lit-dist: error: \d samples in a row of bucket \d+x\d+ could not be read, under \S+: "
                        r"(\w+/\d+\.png, )*\w+/\d+\.png \(the last: crc32 mismatch\)\. .*", one_error(out))


def test_only_bad_images_are_replaced_and_the_final_error_names_the_files_tried(tmp_path, demo_data):
    from lit_dist.data.datamodule import BucketDataModule
    from lit_dist.reading.unreadable import BadImage, UnreadableInARow

    shutil.copytree(demo_data.parent, tmp_path / "shapes")
    dm = BucketDataModule(str(tmp_path / "shapes" / "metadata.parquet"), resolution=32, batch_size_per_device=4,
                          num_workers=0, allow_oversubscription=True)
    dm.setup("fit")
    dataset = dm._splits["train"]
    bucket = int(np.bincount(dataset.bucket_ids).argmax())
    members = np.flatnonzero(dataset.bucket_ids == bucket)
    names = [dataset.filenames[int(dataset.positions[i])].as_py() for i in members]
    for name in names[:3]:  # truncated JPEG-like damage: half a PNG
        garble(tmp_path / "shapes" / name, "truncate")
    batch = dataset[(0, [int(members[0]), int(members[5])], 1.0)]
    assert int(batch["bad_samples"]) == 3 and batch["row"].tolist()[0] == int(dataset.rows[members[3]])
    for name in names[3:9]:
        (tmp_path / "shapes" / name).unlink()  # and six deleted: nine bad in a row from the first
    with pytest.raises(UnreadableInARow) as raised:
        dataset[(0, [int(members[0])], 1.0)]
    assert str(raised.value).split(": ", 1)[1].startswith(", ".join(names[:8]) + " (the last: missing (")
    assert isinstance(raised.value.__cause__, BadImage) and isinstance(raised.value.__cause__.__cause__,
                                                                        FileNotFoundError)


@pytest.mark.process
def test_stale_entries_of_changed_source_files_say_so(tmp_path, demo_data):
    from PIL import Image

    from lit_dist.cache.config import CacheConfig
    from tests.helpers.cache import data_module

    shutil.copytree(demo_data.parent, tmp_path / "shapes")
    cache = tmp_path / "cache"
    dm = data_module(tmp_path / "shapes" / "metadata.parquet", CacheConfig(dir=str(cache)), seed=0)  # the quickstart's keys
    dm.build_cache(torch.device("cpu"))
    name = pq.read_table(demo_data).column("filename")[5].as_py()
    image = tmp_path / "shapes" / name
    Image.new("RGB", Image.open(image).size, (255, 0, 0)).save(image)
    out = lit_dist("fit", *quickstart_args(tmp_path / "runs", tmp_path / "shapes" / "metadata.parquet",
                                           data__cache__dir=cache, **READ))
    assert out.returncode == 3, out.stderr[-3000:]
    assert one_error(out).endswith(
        "pixels: 399 of 400 cached (99.8%), 1 missing (1 of them stale), 0 unreadable sources; stale entries are of "
        "this configuration, built from source files that changed since (their size, modification time or ETag, or "
        "the table's width and height). Build what is missing with `lit-dist cache --config <this config>` (every "
        "rank of a job builds its share), or set data.cache.mode: build.")


@pytest.mark.process
def test_index_files_describe_their_shards(built):
    from lit_dist.cache.shards import index_description, read_index

    cache = built[0] / "cache" / "pixels"
    entry = json.loads((cache / "manifest.json").read_text())["shards"][0]
    index = (cache / "shards" / f"{entry['name']}.index.arrow").read_bytes()
    described = index_description(read_index(index))
    assert described == {k: v for k, v in entry.items() if k not in ("index_bytes", "index_sha256")}
    assert hashlib.sha256(index).hexdigest() == entry["index_sha256"]
