"""Caches of resized pixels and encoder outputs: built once, read instead of decoding, never stale."""

import json
import shutil
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lit_dist.cache.config import CacheConfig
from lit_dist.cache.shards import CorruptEntry, ShardWriter, decode, read_index
from lit_dist.cache.store import CacheStore
from lit_dist.cli.commands.cache import check_cache
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.errors import ConfigError, DataError
from tests.helpers.cache import add_identity_columns, data_module, identity_table

ENCODER = {"class_path": "tests.helpers.encoders.TinyEncoder", "init_args": {"channels": 4, "seed": 0}}


@pytest.fixture
def data(tmp_path):
    """120 demo images whose table has bytes and mtime columns (as scans write them); returns the table path."""
    return identity_table(tmp_path)


def cache_config(tmp_path, **overrides) -> CacheConfig:
    return CacheConfig(**{"dir": str(tmp_path / "cache"), "mode": "build", "encoder": ENCODER, **overrides})


def batches(dm: BucketDataModule, split: str = "train", count: int = 6) -> list[dict]:
    dataset = dm._splits[split]
    if split == "train":
        sampler = dm.train_sampler(1, 0)
    else:
        from lit_dist.data.sampler import BucketBatchSampler

        sampler = BucketBatchSampler(dataset.bucket_ids, dm.batch_size_per_device, 1, 0, dm.seed, shuffle=False)
    out = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        out += [dataset[request] for request in list(sampler)[: count // 2]]
    return out


@pytest.mark.parametrize("layout", ["row_tree", "rows", "plain"])
def test_cached_batches_equal_decoded_batches_bitwise(tmp_path, data, layout):
    cached = data_module(data, cache_config(tmp_path, pixel_layout=layout))
    cached.setup("fit")
    layouts = {s.get("layout") for s in CacheStore(str(tmp_path / "cache")).manifest("pixels")["shards"]}
    assert layouts == ({None} if layout == "plain" else {layout})
    plain = data_module(data, None)
    plain.setup("fit")
    for split in ("train", "val"):
        for a, b in zip(batches(cached, split), batches(plain, split), strict=True):
            assert torch.equal(a["image"], b["image"])  # the same random crops, from the cached covering image
            assert torch.equal(a["row"], b["row"]) and torch.equal(a["label"], b["label"])
            assert a["latent"].dtype == torch.bfloat16 and a["latent"].shape[:2] == (len(a["image"]), 4)
            h, w = a["image"].shape[1:3]
            assert a["latent"].shape[2:] == (h // 8, w // 8)


def test_encoder_entries_are_the_encoder_applied_to_the_centre_crop(tmp_path, data):
    from tests.helpers.encoders import TinyEncoder

    cached = data_module(data, cache_config(tmp_path, pixels=False, encoder_dtype="fp32"))
    cached.setup("fit")
    plain = data_module(data, None, random_crop=False)
    plain.setup("fit")
    a, b = batches(cached, "val", 2)[0], batches(plain, "val", 2)[0]
    assert "image" not in a  # only encoder outputs cached: no image is decoded
    x = plain.on_after_batch_transfer(dict(b), 0)["image"]
    with torch.no_grad():
        expected = TinyEncoder(channels=4, seed=0)(x)
    torch.testing.assert_close(a["latent"], expected, rtol=1e-5, atol=1e-5)


def test_training_from_the_cache_opens_no_source_image(tmp_path, data):
    data_module(data, cache_config(tmp_path)).setup("fit")
    shutil.move(data.parent, tmp_path / "moved")  # the images are gone; the table comes along
    table = tmp_path / "moved" / "metadata.parquet"
    dm = data_module(table, cache_config(tmp_path, mode="read"), root=str(data.parent))
    dm.setup("fit")
    got = batches(dm, "train")
    assert all(int(b["bad_samples"]) == 0 for b in got)


def test_read_mode_names_what_is_missing_and_the_command(tmp_path, data):
    with pytest.raises(DataError, match=r"holds no cache.*lit-dist cache --config"):
        data_module(data, cache_config(tmp_path, mode="read")).setup("fit")
    data_module(data, cache_config(tmp_path, encoder=None)).setup("fit")  # pixels only
    with pytest.raises(DataError, match=r"incomplete.*encoder: 0 of 120 cached.*120 missing.*lit-dist cache --config"):
        data_module(data, cache_config(tmp_path, mode="read")).setup("fit")


def test_another_resolution_is_stale_named_and_rebuilt(tmp_path, data, capsys):
    data_module(data, cache_config(tmp_path)).setup("fit")
    with pytest.raises(DataError, match=r"pixels: 0 of 120 cached.*120 missing \(120 of them stale\).*another "
                                        r"configuration: \w+ \(differs in buckets\)"):
        data_module(data, cache_config(tmp_path, mode="read"), resolution=40).setup("fit")
    rebuilt = data_module(data, cache_config(tmp_path), resolution=40)
    rebuilt.setup("fit")
    assert batches(rebuilt, "train", 2)[0]["image"].shape[1] * batches(rebuilt, "train", 2)[0]["image"].shape[2] > 32 * 32


def test_one_changed_encoder_weight_makes_every_encoder_entry_stale(tmp_path, data):
    data_module(data, cache_config(tmp_path)).setup("fit")
    bumped = {**ENCODER, "init_args": {**ENCODER["init_args"], "bump": 1e-3}}
    with pytest.raises(DataError, match=r"encoder: 0 of 120 cached.*120 of them stale.*differs in .*weights_sha256"):
        data_module(data, cache_config(tmp_path, mode="read", encoder=bumped)).setup("fit")
    old = batches(module_setup(data, cache_config(tmp_path, mode="read")), "val", 2)[0]["latent"]
    new = batches(module_setup(data, cache_config(tmp_path, encoder=bumped)), "val", 2)[0]["latent"]
    assert not torch.equal(old, new)  # rebuilt with the new weights, never served the old entries


def module_setup(path, cache, **overrides) -> BucketDataModule:
    dm = data_module(path, cache, **overrides)
    dm.setup("fit")
    return dm


def test_a_changed_source_file_is_stale_and_rebuilt_alone(tmp_path, data):
    first = module_setup(data, cache_config(tmp_path, encoder=None))
    table = pq.read_table(data)
    name = table.column("filename")[5].as_py()
    image = data.parent / name
    from PIL import Image

    Image.new("RGB", Image.open(image).size, (255, 0, 0)).save(image)
    add_identity_columns_again(data)
    with pytest.raises(DataError, match=r"pixels: 119 of 120 cached.*1 missing \(1 of them stale\)"):
        module_setup(data, cache_config(tmp_path, mode="read", encoder=None))
    plan, report = data_module(data, cache_config(tmp_path, encoder=None)).build_cache(torch.device("cpu"))
    assert report["samples"] == 1  # only the changed image was decoded again
    assert first is not None


def add_identity_columns_again(path) -> None:
    table = pq.read_table(path).drop_columns(["bytes", "mtime"])
    pq.write_table(table, path)
    add_identity_columns(path)


def test_a_flipped_byte_is_caught_replaced_while_training_and_rebuilt(tmp_path, data, capsys):
    dm = module_setup(data, cache_config(tmp_path, encoder=None))
    shard = next((tmp_path / "cache" / "pixels" / "shards").glob("*[0-9a-f].arrow"))
    index = read_index((shard.parent / (shard.stem + ".index.arrow")).read_bytes())
    raw = bytearray(shard.read_bytes())
    raw[int(index.column("offset")[3].as_py()) + 200] ^= 0xFF  # inside the fourth sample's bytes
    shard.write_bytes(bytes(raw))

    assert check_cache(data_module(data, cache_config(tmp_path, mode="read", encoder=None))) == 3
    assert "does not match its sha256 (corrupted)" in capsys.readouterr().out

    # While training the entry fails its crc32 and is replaced like a bad image: counted, never a crash.
    dm = module_setup(data, cache_config(tmp_path, mode="read", encoder=None))
    bad_row = int(np.flatnonzero(dm._cache_views[0]["pixels"].offset == index.column("offset")[3].as_py())[0])
    view = dm._cache_views[0]["pixels"]
    with pytest.raises(Exception, match="crc32"):
        view.read(bad_row)

    # A build verifies every shard's sha256, drops the damaged one and rebuilds its samples.
    _, report = data_module(data, cache_config(tmp_path, encoder=None)).build_cache(torch.device("cpu"), verify=True)
    assert report["samples"] == int(index.num_rows)
    assert "is damaged: does not match its sha256" in capsys.readouterr().out
    assert check_cache(data_module(data, cache_config(tmp_path, mode="read", encoder=None))) == 0


def test_a_corrupt_entry_is_replaced_by_another_sample_of_its_bucket_and_counted(tmp_path, data):
    dm = module_setup(data, cache_config(tmp_path, encoder=None))
    view = dm._splits["train"].cache["pixels"]
    view.crc[:] ^= 1  # every entry fails its check: each sample is replaced, then the batch gives up
    dataset = dm._splits["train"]
    sampler = dm.train_sampler(1, 0)
    first = next(iter(sampler))
    view.crc[:] ^= 1
    target = first[1][0]
    view.crc[int(dataset.positions[target])] ^= 1  # one entry bad
    batch = dataset[first]
    assert int(batch["bad_samples"]) == 1
    assert target not in batch["row"].tolist() or dataset.rows[target] not in batch["row"].tolist()


def test_torn_and_unlisted_shards_are_removed_and_finished_shards_of_a_killed_build_kept(tmp_path, data):
    from lit_dist.cache.build import _run

    cfg = cache_config(tmp_path, encoder=None, shard_size_mb=1)
    dm = data_module(data, cfg)
    plan = dm.cache_plan(dm.read())
    plan.store.check(create=True)
    # A build killed after it finished (and listed) one shard of 40 samples, while writing a second.
    found, _ = plan.match()
    from lit_dist.cache.build import _work

    work = _work(plan, found, 8)[:5]
    done = sum(len(rows) for _, rows, _ in work)
    _run(plan, work, torch.device("cpu"), 0, {"samples": 0, "unreadable": 0, "bytes": 0, "raw_bytes": 0, "shards": 0},
         rank=0, progress=False)
    shards = tmp_path / "cache" / "pixels" / "shards"
    (shards / "torn.arrow").write_bytes(b"ARROW1\0\0 half a shard")
    (shards / ".20261122-x.arrow.tmp-1234").write_bytes(b"partial")
    _, report = dm.build_cache(torch.device("cpu"))
    assert report["samples"] == 120 - done  # the listed shard counted; only the rest was built
    names = sorted(p.name for p in shards.iterdir())
    assert "torn.arrow" not in names and not any(n.startswith(".") for n in names)
    assert check_cache(data_module(data, cache_config(tmp_path, mode="read", encoder=None))) == 0


def test_an_unreadable_source_is_recorded_and_replaced_at_load(tmp_path, data):
    table = pq.read_table(data)
    name = table.column("filename")[7].as_py()
    (data.parent / name).write_bytes(b"not an image")
    add_identity_columns_again(data)
    _, report = data_module(data, cache_config(tmp_path, encoder=None)).build_cache(torch.device("cpu"))
    assert report["unreadable"] == 1
    dm = module_setup(data, cache_config(tmp_path, mode="read", encoder=None))  # known bad is not missing
    view = dm._cache_views[0]["pixels"]
    assert int((view.shard >= 0).sum()) == 120 and int((view.length == 0).sum()) == 1


def test_reader_keeps_14_bytes_per_sample_and_field_and_reads_one_range(tmp_path, data):
    dm = module_setup(data, cache_config(tmp_path))
    for view in dm._cache_views[0].values():
        per_sample = sum(a.nbytes for a in (view.shard, view.offset, view.length, view.crc)) / len(view.shard)
        assert per_sample == 14
    view = dm._cache_views[0]["pixels"]
    shard, offset, length = int(view.shard[10]), int(view.offset[10]), int(view.length[10])
    got = view._read(shard, offset, length)  # a slice of the mapped shard: that sample's bytes, nothing more
    with open(view.urls[shard], "rb") as f:
        f.seek(offset)
        assert len(got) == length and bytes(got) == f.read(length)
    assert view.read(10).shape[2] == 3


def test_shard_round_trip_and_compression_choice():
    rng = np.random.default_rng(0)
    arrays = [np.repeat(rng.integers(0, 4, (20, 30, 1), dtype=np.uint8), 3, axis=2) for _ in range(5)]
    sizes = {}
    for compression in ("zstd", "none"):
        writer = ShardWriter("uint8", compression)
        for i, a in enumerate(arrays):
            writer.add(i, 100 + i, a)
        data, index = writer.finish()
        table = read_index(index)
        for i, a in enumerate(arrays):
            at, n = table.column("offset")[i].as_py(), table.column("length")[i].as_py()
            assert np.array_equal(decode(data[at : at + n], table.column("crc32")[i].as_py(), "uint8", writer.encoding), a)
        assert pa.ipc.open_stream(pa.py_buffer(data)).read_all().num_rows == 5  # any Arrow reader opens a shard
        sizes[compression] = len(data)
    assert sizes["zstd"] < sizes["none"] / 2
    noise = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)  # zstd would save nothing
    writer = ShardWriter("uint8", "zstd", min_savings=0.1)
    writer.add(0, 0, noise)
    data, index = writer.finish()
    table = read_index(index)
    plain = ShardWriter("uint8", "none")
    plain.add(0, 0, noise)
    assert table.column("length")[0].as_py() == read_index(plain.finish()[1]).column("length")[0].as_py()  # as is
    at, n = table.column("offset")[0].as_py(), table.column("length")[0].as_py()
    assert np.array_equal(decode(data[at : at + n], table.column("crc32")[0].as_py(), "uint8", writer.encoding), noise)


def test_images_stored_as_differences_of_rows_round_trip_smaller_and_plain_shards_still_decode():
    from lit_dist.cache.shards import PLAIN, ROW_TREE, ROWS

    rng = np.random.default_rng(0)
    # A photo-like image: smooth light across it and sensor-like noise on top, whose plain bytes hardly compress.
    light = np.linspace(0, 200, 96)[:, None, None] + np.linspace(0, 50, 128)[None, :, None]
    image = np.clip(light + rng.normal(0, 3, (96, 128, 3)), 0, 255).astype(np.uint8)
    sizes = {}
    for layout in (ROW_TREE, ROWS, PLAIN):  # plain: as shards from before layouts (no layout in the manifest entry)
        writer = ShardWriter("uint8", "zstd", min_savings=0, layout=layout)
        assert writer.layout == (None if layout == PLAIN else layout)
        writer.add(0, 0, image)
        data, index = writer.finish()
        table = read_index(index)
        at, n = table.column("offset")[0].as_py(), table.column("length")[0].as_py()
        back = decode(data[at : at + n], table.column("crc32")[0].as_py(), "uint8", writer.encoding)
        assert back.dtype == np.uint8 and np.array_equal(back, image)
        sizes[layout] = n
    assert sizes[ROWS] < sizes[ROW_TREE] < 0.8 * sizes[PLAIN], sizes
    assert ShardWriter("bf16", layout=ROWS).layout is None, "only images are differenced"


def test_an_entry_of_an_unknown_layout_is_corrupt_not_served_as_pixels():
    image = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
    writer = ShardWriter("uint8", "none", layout="plain")
    writer.add(0, 0, image)
    data, index = writer.finish()
    table = read_index(index)
    at, n = table.column("offset")[0].as_py(), table.column("length")[0].as_py()
    entry, crc = data[at : at + n], table.column("crc32")[0].as_py()
    assert np.array_equal(decode(entry, crc, "uint8", {"values": "zstd"}), image)
    with pytest.raises(CorruptEntry, match="unknown layout 'zigzag'"):
        decode(entry, crc, "uint8", {"values": "zstd", "layout": "zigzag"})


def test_shards_written_before_values_carried_their_compression_still_decode():
    """Shards of format 2 (no "values" in their manifest entry) have zstd-compressed IPC messages."""
    from lit_dist.cache.shards import schema

    image = np.repeat(np.arange(60, dtype=np.uint8).reshape(6, 10, 1), 3, axis=2)
    batch = pa.record_batch([pa.array([0], pa.uint64()), pa.array([7], pa.uint64()), pa.array([list(image.shape)],
                             pa.list_(pa.int32())), pa.array([image.tobytes()], pa.binary())], schema=schema("uint8"))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    stream = sink.getvalue().to_pybytes()
    start = 8 + int.from_bytes(stream[4:8], "little")  # after the schema message
    message = stream[start:-8]  # before the end-of-stream marker
    assert np.array_equal(decode(message, zlib.crc32(message), "uint8", {}), image)


@pytest.mark.parametrize("layout", ["row_tree", "rows"])
@pytest.mark.parametrize("shape", [(1, 5, 3), (2, 2), (3, 4), (17, 3, 3), (299, 224, 3), (256, 341, 3), (4, 128, 128)])
def test_undoing_differences_of_rows_gives_the_image_back_for_any_shape(shape, layout):
    from lit_dist.cache.shards import _filter

    difference, undo = _filter(layout, np.dtype(np.uint8), len(shape))
    image = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
    differences = difference(image)
    assert shape[0] == 1 or not np.array_equal(differences, image)
    back = undo(differences)
    assert back.shape == image.shape and np.array_equal(back, image)
    assert np.array_equal(differences, difference(image)), "the input is left as it was"
    assert undo(differences, out=differences) is differences and np.array_equal(differences, image), "in place"


@pytest.mark.parametrize("layout", ["row_tree", "rows"])
def test_restoring_in_place_falls_back_to_a_copy_for_read_only_bytes(layout):
    from lit_dist.cache.shards import restored, stored

    image = np.random.default_rng(3).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    raw = np.frombuffer(bytes(stored(image, layout)), np.uint8)  # read-only, as a buffer we do not own
    assert np.array_equal(restored(raw, np.dtype(np.uint8), list(image.shape), layout, in_place=True), image)


def test_bad_cache_configs_are_named_together(tmp_path, data):
    bad = CacheConfig(dir=str(tmp_path), pixels=False, encoder=None, pixel_layout="png", compression_level=40,
                      shard_size_mb=9000)
    with pytest.raises(ConfigError, match=r"(?s)4 problems.*caches nothing.*pixel_layout = 'png': must be one of "
                                          r"row_tree, rows, plain.*compression_level = 40.*shard_size_mb = 9000"):
        data_module(data, bad)
    with pytest.raises(ConfigError, match=r"data.cache.dir is not set"):
        data_module(data, CacheConfig(mode="read"))
    assert data_module(data, CacheConfig()).cache is None  # the default: no folder, no cache


def test_a_folder_that_is_not_a_cache_or_from_a_newer_lit_dist_is_refused(tmp_path, data):
    other = tmp_path / "cache"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(DataError, match=r"other files in it and no CACHE.json: it is not a lit-dist cache"):
        module_setup(data, cache_config(tmp_path))
    (other / "holiday.jpg").unlink()
    (other / "CACHE.json").write_text(json.dumps({"kind": "lit-dist cache", "format": 99}))
    with pytest.raises(DataError, match=r"newer lit-dist \(cache format 99"):
        module_setup(data, cache_config(tmp_path))


def test_a_cache_path_that_cannot_be_written_is_a_config_error(tmp_path, data):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"data.cache.dir = .*file/cache.*cannot create it"):
        module_setup(data, CacheConfig(dir=str(tmp_path / "file" / "cache"), encoder=None))


def test_encoder_that_does_not_import_or_whose_shape_varies_is_a_config_error(tmp_path, data):
    with pytest.raises(ConfigError, match=r"encoder.class_path = 'nowhere.Encoder' does not import"):
        module_setup(data, cache_config(tmp_path, encoder={"class_path": "nowhere.Encoder"}))
    flat = {"class_path": "tests.helpers.encoders.FlatEncoder"}
    with pytest.raises(ConfigError, match=r"non-spatial dimensions differ between buckets"):
        module_setup(data, cache_config(tmp_path, encoder=flat))
    pooled = module_setup(data, cache_config(tmp_path, encoder={"class_path": "tests.helpers.encoders.PooledEncoder"}))
    assert all(b["latent"].shape[1:] == (3,) for b in batches(pooled, "val", 4))


def test_a_run_trained_from_the_cache_resumes_bitwise_and_equals_decoding(tmp_path, demo_data):
    from tests.helpers.training import run, steps_per_epoch

    cache = {"cache": CacheConfig(dir=str(tmp_path / "cache"), mode="build")}
    per_epoch = steps_per_epoch(demo_data)
    stop, end = per_epoch + per_epoch // 2, 2 * per_epoch + 3
    decoded, _, _ = run(tmp_path / "a", demo_data, max_steps=end)
    straight, _, _ = run(tmp_path / "b", demo_data, max_steps=end, data=cache)  # builds the cache, then trains
    run(tmp_path / "c", demo_data, max_steps=end, stop=stop, data={"cache": CacheConfig(dir=str(tmp_path / "cache"),
                                                                                      mode="read")})
    resumed, trainer, _ = run(tmp_path / "c", demo_data, max_steps=end, resume=True, data=cache)
    assert trainer.global_step == end
    for (name, a), b, c in zip(straight.state_dict().items(), resumed.state_dict().values(),
                               decoded.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"
        assert torch.equal(a, c), f"{name} differs from the run that decoded its images"


# Image-sized RGB outputs: the tests' CNN takes them as it takes images.
THREE = {"class_path": "tests.helpers.encoders.TinyEncoder", "init_args": {"channels": 3, "scale": 1}}


@pytest.fixture(scope="module")
def few_images(tmp_path_factory):
    """60 demo images: the on-demand test trains two epochs in batches of 1, twice (with the 400 of demo_data, 17 s)."""
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path_factory.mktemp("few") / "shapes" / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=60, seed=0)
    return path


@pytest.mark.parametrize("fields", [{"encoder": ENCODER}, {"encoder": THREE, "pixels": False}])
def test_ondemand_fills_the_cache_in_epoch_one_and_epoch_two_opens_no_source_image(tmp_path, few_images, monkeypatch,
                                                                                   fields):
    from lightning.pytorch import Callback

    from lit_dist.data.dataset import BucketImageDataset
    from tests.helpers.training import run, steps_per_epoch

    opened = []
    real = BucketImageDataset.covering
    monkeypatch.setattr(BucketImageDataset, "covering", lambda self, *a: opened.append(a) or real(self, *a))
    per_epoch_opens = []

    class CountOpens(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            per_epoch_opens.append(len(opened) - sum(per_epoch_opens))

    # Batches of 1: every training sample is seen in epoch 1 (no samples wait for a later epoch).
    steps = 2 * steps_per_epoch(few_images, batch_size=1)
    cache = CacheConfig(dir=str(tmp_path / "cache"), mode="ondemand", encoder_dtype="fp32", **fields)
    key = "image" if fields.get("pixels", True) else "latent"
    model, trainer, _ = run(tmp_path / "a", few_images, max_steps=steps, extra=[CountOpens()], data={"cache": cache},
                            input_key=key, batch_size=1)
    train_rows = steps // 2
    assert per_epoch_opens == [train_rows, 0], per_epoch_opens
    # num_workers=0: only its plan is read, and loader workers would start a fork server (a process).
    dm = BucketDataModule(str(few_images), resolution=32, batch_size_per_device=1, val_fraction=0.1, cache=cache,
                          num_workers=0)
    _, coverage = dm.cache_plan(dm.read()).match()
    assert all(c.hits == train_rows for c in coverage.values())  # validation never ran here, so its rows wait
    # What epoch 1 trained on is what the cache now serves: the same run again opens nothing, ends the same.
    again, _, _ = run(tmp_path / "b", few_images, max_steps=steps, data={"cache": cache}, input_key=key, batch_size=1)
    assert len(opened) == train_rows
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.process
def test_plan_shows_the_cache_coverage_and_refuses_mode_read_when_incomplete(tmp_path, demo_data):
    from tests.conftest import lit_dist, quickstart_args

    args = ["plan", *quickstart_args(None, demo_data, data__cache__dir=tmp_path / "cache", data__cache__mode="read",
                                     data__allow_oversubscription=True)]
    out = lit_dist(*args)
    assert out.returncode == 3 and "holds no cache" in out.stdout, out.stdout + out.stderr[-2000:]
    assert lit_dist("cache", *args[1:]).returncode == 0
    out = lit_dist(*args)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "pixels: 400 of 400 cached (100.0%)" in out.stdout and "compression" in out.stdout


@pytest.mark.parametrize("encoder", [ENCODER, None])
def test_a_build_decodes_in_this_process_when_its_encoder_runs_on_the_cpu(monkeypatch, tmp_path, data, encoder):
    """A loader worker decoding beside a CPU encoder takes a core from its threads (bench_pipeline); a pixel cache
    is all decoding, and workers do it."""
    from lit_dist.cache.build import _Decode

    here = []  # batches decoded in this process (a worker's calls are counted in its own copy)
    getitem = _Decode.__getitem__
    monkeypatch.setattr(_Decode, "__getitem__", lambda self, j: (here.append(j), getitem(self, j))[1])
    _, report = data_module(data, cache_config(tmp_path, encoder=encoder), num_workers=2).build_cache(torch.device("cpu"))
    assert report["samples"] == 120
    assert len(here) == (len(set(here)) if encoder else 0) and (len(here) > 0) == (encoder is not None)


CAPTIONS = {"class_path": "tests.helpers.encoders.ByteCaptionEncoder", "init_args": {"dim": 8}}


def test_caption_encoder_outputs_are_cached_per_caption_and_a_changed_caption_is_stale(tmp_path, data):
    from tests.helpers.encoders import ByteCaptionEncoder

    cache = cache_config(tmp_path, encoder=None, caption_encoder=CAPTIONS, encoder_dtype="fp32")
    dm = module_setup(data, cache)
    table = pq.read_table(data)
    captions = table.column("caption").to_pylist()
    with torch.no_grad():
        expected = ByteCaptionEncoder(dim=8)(captions)
    for batch in batches(dm, "train", 4):
        assert batch["caption_embedding"].shape == (len(batch["image"]), 8)
        torch.testing.assert_close(batch["caption_embedding"], expected[batch["row"]])
        assert batch["caption"] == [captions[r] for r in batch["row"].tolist()]

    captions[3] = "a new caption"  # one caption rewritten: its embedding is stale, its pixels are not
    pq.write_table(table.set_column(table.column_names.index("caption"), "caption", pa.array(captions)), data)
    with pytest.raises(DataError, match=r"caption_encoder: 119 of 120 cached.*1 missing \(1 of them stale\)"):
        module_setup(data, cache_config(tmp_path, mode="read", encoder=None, caption_encoder=CAPTIONS,
                                        encoder_dtype="fp32"))
    _, report = data_module(data, cache).build_cache(torch.device("cpu"))
    assert report["samples"] == 1 and report["needed"] == 1


@pytest.mark.parametrize("memo_bytes", [None, 1])
def test_a_repeated_caption_is_encoded_once_per_build(monkeypatch, tmp_path, data, memo_bytes):
    import lit_dist.cache.build as build
    from tests.helpers.encoders import ByteCaptionEncoder

    seen = []
    forward = ByteCaptionEncoder.forward
    monkeypatch.setattr(ByteCaptionEncoder, "forward", lambda self, texts: (seen.extend(texts), forward(self, texts))[1])
    monkeypatch.setattr(build, "CAPTION_BATCH", 8)  # 15 calls: a caption met in an earlier call is remembered
    if memo_bytes is not None:  # room for one caption's encoding: a caption met again after others is encoded again
        monkeypatch.setattr(build, "CAPTION_MEMO_BYTES", memo_bytes)
    captions = pq.read_table(data).column("caption").to_pylist()
    dm = module_setup(data, cache_config(tmp_path, encoder=None, caption_encoder=CAPTIONS, encoder_dtype="fp32"))
    built = [t for t in seen if t]  # the empty caption is encoded when the cache is prepared
    if memo_bytes is None:
        assert sorted(built) == sorted(set(captions)) and len(built) < len(captions)
    else:
        assert len(set(captions)) < len(built) <= len(captions)
    with torch.no_grad():
        expected = ByteCaptionEncoder(dim=8)(captions)
    rows = 0
    for batch in batches(dm, "train", 30):  # every caption's entry is its own encoding
        torch.testing.assert_close(batch["caption_embedding"], expected[batch["row"]])
        rows += len(batch["row"])
    assert rows >= 100


def test_caption_encoder_needs_a_caption_column_and_mode_build(tmp_path, data):
    table = pq.read_table(data).drop_columns(["caption"])
    pq.write_table(table, data)
    with pytest.raises(DataError, match="caption_encoder needs a caption column"):
        module_setup(data, cache_config(tmp_path, encoder=None, caption_encoder=CAPTIONS))
    with pytest.raises(ConfigError, match="caption_encoder is built before training, not on demand"):
        data_module(data, cache_config(tmp_path, mode="ondemand", caption_encoder=CAPTIONS))


def test_mixed_datasets_read_their_own_entries_from_one_cache(tmp_path, demo_data):
    from lit_dist.data.sources import DatasetSource

    second = tmp_path / "b"
    shutil.copytree(demo_data.parent, second)  # the same file names under another root: other samples
    sources = [DatasetSource(metadata=str(demo_data), weight=3), DatasetSource(metadata=str(second / "metadata.parquet"))]

    def mixed(cache):
        dm = BucketDataModule(datasets=sources, resolution=32, batch_size_per_device=4, num_workers=0, cache=cache)
        dm.setup("fit")
        return list(dm.train_dataloader())

    cached = mixed(cache_config(tmp_path, encoder=None))
    plain = mixed(None)
    assert len(cached) == len(plain)
    for a, b in zip(cached, plain, strict=True):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["dataset"], b["dataset"])
    _, coverage = BucketDataModule(datasets=sources, resolution=32, cache=cache_config(tmp_path, encoder=None)).cache_plan(
        BucketDataModule(datasets=sources, resolution=32, cache=cache_config(tmp_path, encoder=None)).read()).match()
    assert coverage["pixels"].hits == 800  # 400 rows of each dataset, not 400 shared by name


@pytest.mark.process
def test_cached_batches_come_from_threads_in_order_and_equal_the_worker_processes(tmp_path, data):
    from lit_dist.data.threads import ThreadLoader

    threaded = module_setup(data, cache_config(tmp_path), num_workers=2)
    processes = module_setup(data, cache_config(tmp_path, threads=False), num_workers=2)
    a, b = threaded.train_dataloader(), processes.train_dataloader()
    assert isinstance(a, ThreadLoader) and not isinstance(b, ThreadLoader) and len(a) == len(b)
    for epoch in (0, 1):
        a.sampler.set_epoch(epoch)
        b.sampler.set_epoch(epoch)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["image"], y["image"]) and torch.equal(x["latent"], y["latent"])
    batches = iter(a)
    next(batches)
    batches.close()  # a consumer that stops early (Lightning at max_steps) leaves no thread behind
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("lit-dist-cache-loader")]
    assert not isinstance(threaded.predict_dataloader(), ThreadLoader)  # Lightning splits prediction itself


def test_a_cache_of_captions_alone_leaves_the_images_to_be_decoded_in_worker_processes(tmp_path, data):
    from lit_dist.data.threads import ThreadLoader

    dm = module_setup(data, cache_config(tmp_path, pixels=False, encoder=None, caption_encoder=CAPTIONS), num_workers=1)
    loader = dm.train_dataloader()
    assert not isinstance(loader, ThreadLoader)  # decoding in threads would contend with training for the GIL
    batch = dm._splits["train"][next(iter(loader.sampler))]
    assert batch["image"].shape[-1] == 3 and "caption_embedding" in batch


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_float_entries_round_trip_through_the_byte_shuffle(dtype):
    from lit_dist.cache.build import _stored

    values = torch.randn(3, 4, 5, 6)
    arrays = _stored(values, dtype)  # as a build stores encoder outputs
    writer = ShardWriter(dtype, "zstd")
    for i, a in enumerate(arrays):
        writer.add(i, i, a)
    data, index = writer.finish()
    table = read_index(index)
    from lit_dist.cache.shards import from_stored

    for i, a in enumerate(arrays):
        at, n = table.column("offset")[i].as_py(), table.column("length")[i].as_py()
        back = decode(data[at : at + n], table.column("crc32")[i].as_py(), dtype, writer.encoding)
        assert np.array_equal(back, a)
        expected = values[i].to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
        assert torch.equal(from_stored(back, dtype), expected)
