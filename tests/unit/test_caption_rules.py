"""A dataset's captions as training reads them (lit_dist/reading/tags.py): tag orders with keep_tokens, cached once
per order; each dataset's own caption dropout and caption column."""

import subprocess
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.sources import DatasetSource
from lit_dist.errors import ConfigError, DataError
from lit_dist.reading.tags import CaptionRule, ordered
from tests.conftest import REPO
from tests.helpers.cache import data_module, identity_table
from tests.unit.test_cache import batches, cache_config

pytestmark = pytest.mark.unit



@pytest.fixture
def data(tmp_path):
    """120 demo images, their table with bytes and mtime columns (a cache keys on them); returns the table path."""
    return identity_table(tmp_path)


# Encodes the same tags in another order differently: a sample's encoding says which order it read.
CAPTIONS = {"class_path": "tests.helpers.encoders.ByteCaptionEncoder", "init_args": {"dim": 8, "ordered": True}}
TAGS = "masterpiece, 1girl, red hair, smiling, outdoors, sunset, blue sky"


def test_a_tag_order_keeps_the_leading_tags_and_is_the_same_in_every_interpreter():
    assert ordered(TAGS, 0, 2) == TAGS  # order 0: as written
    tags = [t.strip() for t in TAGS.split(",")]
    shuffles = [ordered(TAGS, k, 2) for k in range(1, 9)]
    for text in shuffles:
        got = text.split(", ")
        assert got[:2] == tags[:2] and sorted(got[2:]) == sorted(tags[2:]), text
    assert len(set(shuffles)) > 4, shuffles  # orders differ
    assert ordered("one tag", 3, 0) == "one tag" and ordered("", 3, 1) == ""
    assert ordered(" a ,b,  c ", 1, 5) == "a, b, c"  # more kept than there are tags: all kept, in order
    # str seeds hash with SHA-512, not with the interpreter's randomised hash: another process agrees.
    code = f"from lit_dist.reading.tags import ordered; print(ordered({TAGS!r}, 3, 2))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123"}, cwd=REPO)
    assert other.stdout.strip() == ordered(TAGS, 3, 2)


def test_a_samples_tag_order_is_drawn_evenly_from_seed_epoch_and_index():
    rule = CaptionRule(tag_orders=4)
    drawn = [rule.order(7, epoch, index) for epoch in range(4) for index in range(1000)]
    counts = Counter(drawn)
    assert sorted(counts) == [0, 1, 2, 3] and min(counts.values()) > 900, counts
    assert drawn == [rule.order(7, epoch, index) for epoch in range(4) for index in range(1000)]  # a resume reads the same
    assert [rule.order(7, 0, i) for i in range(50)] != [rule.order(7, 1, i) for i in range(50)]  # a new epoch, new orders
    assert CaptionRule().order(7, 3, 11) == 0


def tag_captions(path) -> list[str]:
    """The table's captions rewritten as comma-separated tags (four or five each); returns them."""
    table = pq.read_table(path)
    captions = [f"shapes, {c}, tag{i % 5}, mark{i % 3}" + (", extra" if i % 2 else "")
                for i, c in enumerate(table.column("caption").to_pylist())]
    pq.write_table(table.set_column(table.column_names.index("caption"), "caption", pa.array(captions)), path)
    return captions


def test_training_reads_each_caption_in_one_of_its_cached_tag_orders_and_evaluation_as_written(tmp_path, data):
    from tests.helpers.encoders import ByteCaptionEncoder

    captions = tag_captions(data)
    cache = cache_config(tmp_path, encoder=None, caption_encoder=CAPTIONS, encoder_dtype="fp32")
    first = data_module(data, cache)
    first.setup("fit")  # builds order 0 only: a cache made before tag orders
    with pytest.raises(DataError, match=r"caption_encoder: 120 of 360 cached"):  # order 0 is served, 1 and 2 are not
        data_module(data, cache_config(tmp_path, mode="read", encoder=None, caption_encoder=CAPTIONS,
                                       encoder_dtype="fp32"), tag_orders=3, keep_tokens=1).setup("fit")
    dm = data_module(data, cache, tag_orders=3, keep_tokens=1)
    dm.setup("fit")
    encoder = ByteCaptionEncoder(dim=8, ordered=True)
    seen = Counter()
    train = batches(dm, "train", 30)
    for batch in train:
        for row, text in zip(batch["row"].tolist(), batch["caption"], strict=True):
            orders = [ordered(captions[row], k, 1) for k in range(3)]
            assert text in orders, (text, orders)
            assert text.split(", ")[0] == "shapes"  # the kept tag
            seen[orders.index(text)] += 1
        with torch.no_grad():  # each sample's cached encoding is its text's: order and text travel together
            torch.testing.assert_close(batch["caption_embedding"], encoder(batch["caption"]))
    assert sorted(seen) == [0, 1, 2] and min(seen.values()) > 20, seen
    again = data_module(data, cache, tag_orders=3, keep_tokens=1)
    again.setup("fit")
    assert [b["caption"] for b in batches(again, "train", 30)] == [b["caption"] for b in train]  # as a resume reads
    for batch in batches(dm, "val", 4):
        assert batch["caption"] == [captions[r] for r in batch["row"].tolist()] and "caption_dropout" not in batch
        with torch.no_grad():
            torch.testing.assert_close(batch["caption_embedding"], encoder(batch["caption"]))


def test_without_a_cache_the_caption_text_travels_in_its_tag_order(tmp_path, data):
    captions = tag_captions(data)
    dm = data_module(data, None, tag_orders=4)
    dm.setup("fit")
    texts = [(r, t) for b in batches(dm, "train", 20) for r, t in zip(b["row"].tolist(), b["caption"], strict=True)]
    assert all(t in [ordered(captions[r], k, 0) for k in range(4)] for r, t in texts)
    assert sum(t != captions[r] for r, t in texts) > len(texts) // 2


def test_each_dataset_drops_its_captions_at_its_own_rate(tmp_path, data):
    import shutil

    from lit_dist.model.objectives import FlowMatching

    second = tmp_path / "b"
    shutil.copytree(data.parent, second)
    sources = [DatasetSource(metadata=str(data), caption_dropout=0.9),
               DatasetSource(metadata=str(second / "metadata.parquet"))]
    dm = BucketDataModule(datasets=sources, resolution=32, batch_size_per_device=8, num_workers=0,
                          allow_oversubscription=True)
    dm.setup("fit")
    train = batches(dm, "train", 20)
    for batch in train:
        if int(batch["dataset"][0]) == 0:
            assert torch.equal(batch["caption_dropout"], torch.full((len(batch["row"]),), 0.9))
        else:
            assert "caption_dropout" not in batch
    assert {int(b["dataset"][0]) for b in train} == {0, 1}

    objective = FlowMatching(condition="caption", condition_dropout=0.1)
    objective.bind("image", "label")
    embedding = torch.ones(20_000, 4)

    def dropped(**extra) -> float:
        torch.manual_seed(0)
        cond = objective.condition_of({"caption_embedding": embedding, **extra}, train=True)
        return float((cond == 0).all(1).float().mean())

    assert abs(dropped() - 0.1) < 0.01
    assert abs(dropped(caption_dropout=torch.full((20_000,), 0.9)) - 0.9) < 0.01
    assert dropped(caption_dropout=torch.zeros(20_000)) == 0.0
    torch.manual_seed(0)  # without a dataset rate: the draw is the one before this knob (a run is bitwise the same)
    got = objective.condition_of({"caption_embedding": embedding}, train=True)
    torch.manual_seed(0)
    assert torch.equal(got, torch.where((torch.rand(20_000) < 0.1)[:, None], torch.zeros_like(embedding), embedding))
    labels = FlowMatching(condition="label", condition_dropout=0.1, null_label=0)
    labels.bind("image", "label")
    with pytest.raises(ConfigError, match="data.caption_dropout drops captions"):
        labels.condition_of({"label": torch.zeros(4, dtype=torch.int64), "caption_dropout": torch.zeros(4)}, train=True)


def test_a_caption_column_is_read_as_the_captions_from_any_table(tmp_path, data):
    table = pq.read_table(data)
    texts = [f"text {i}" for i in range(len(table))]
    pq.write_table(table.append_column("alt_text", pa.array(texts)), data)
    dm = data_module(data, None, caption_column="alt_text")
    dm.setup("fit")
    for batch in batches(dm, "train", 4):
        assert batch["caption"] == [texts[r] for r in batch["row"].tolist()]
    with pytest.raises(DataError, match=r"caption_column = 'nope': .* has no such column \(it has: .*alt_text"):
        data_module(data, None, caption_column="nope").setup("fit")


def test_tag_order_settings_that_cannot_work_are_refused_in_one_message(data):
    with pytest.raises(ConfigError) as caught:
        data_module(data, None, keep_tokens=2, caption_dropout=1.0)
    assert "data.keep_tokens = 2 keeps tags in front of shuffled ones" in str(caught.value)
    assert "data.caption_dropout = 1.0: must be in [0, 1)" in str(caught.value)
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].tag_orders = 0: must be >= 1"):
        BucketDataModule(datasets=[DatasetSource(metadata=str(data), tag_orders=0)])
