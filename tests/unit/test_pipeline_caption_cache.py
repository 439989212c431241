"""A pipeline's caption fields through the caption cache: one vector per caption on disk, the family's dict in the
batch, the empty caption beside it (zeros for SDXL, the encoded "" for PixArt), and condition dropout and guidance
that put the empty caption where a caption was dropped while SDXL's size conditions stay."""

import os

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lit_dist.cache.captions import FOLDER, Layout, empty_key  # noqa: E402
from lit_dist.cache.config import CacheConfig  # noqa: E402
from lit_dist.cache.encoders import PipelineTextEncoder  # noqa: E402
from lit_dist.errors import ConfigError, DataError  # noqa: E402
from lit_dist.model.objectives import FlowMatching  # noqa: E402
from lit_dist.model.sampling import null_condition  # noqa: E402
from tests.helpers.cache import data_module  # noqa: E402
from tests.helpers.pipelines import save_pipeline  # noqa: E402

TOKENS = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    return {family: str(save_pipeline(family, root / family)) for family in ("sdxl", "pixart")}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from lit_dist.data.demo.shapes import create_shapes_dataset

    path = tmp_path_factory.mktemp("shapes") / "metadata.parquet"
    create_shapes_dataset(str(path), num_images=24, seed=1)
    return path


def _spec(folder: str) -> dict:
    return {"class_path": "lit_dist.cache.encoders.PipelineTextEncoder",
            "init_args": {"pipeline": folder, "max_length": TOKENS}}


def _cache(tmp_path, folder: str, **overrides) -> CacheConfig:
    return CacheConfig(**{"dir": str(tmp_path / "cache"), "mode": "build", "pixels": True, "encoder": None,
                          "caption_encoder": _spec(folder), "encoder_dtype": "bf16", **overrides})


def _batch(dm) -> dict:
    """The first training batch as the model gets it (collated, then the data module's on_after_batch_transfer)."""
    return dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)


@pytest.mark.parametrize("family", ["sdxl", "pixart"])
def test_the_batch_holds_the_family_s_fields_and_the_empty_caption_as_its_pipeline_makes_it(family, folders, shapes,
                                                                                           tmp_path):
    dm = data_module(shapes, _cache(tmp_path, folders[family]))
    dm.setup("fit")
    batch = _batch(dm)
    encoder = PipelineTextEncoder(folders[family], max_length=TOKENS).eval()
    with torch.no_grad():
        expected = encoder(batch["caption"])
        blank = encoder([""])
    got = batch["caption_embedding"]
    assert isinstance(got, dict) and set(got) == set(expected)
    for key, value in expected.items():  # stored in bf16: the encoder's output rounded once
        torch.testing.assert_close(got[key], value.to(torch.bfloat16).float(), rtol=0, atol=0, msg=key)
    empty = batch[empty_key("caption_embedding")]
    assert set(empty) == set(expected) and all(len(v) == 1 for v in empty.values())
    if family == "sdxl":  # force_zeros_for_empty_prompt in its model_index.json
        assert all(not v.any() for v in empty.values())
    else:
        for key in expected:
            torch.testing.assert_close(empty[key], blank[key].to(torch.bfloat16).float(), rtol=0, atol=0)
        assert empty["mask"].sum() < got["mask"][0].sum(), "the empty caption has fewer tokens than a caption"

    # The same cache read (mode read) in a new module: the layout and empty caption come from the cache folder.
    again = data_module(shapes, _cache(tmp_path, folders[family], mode="read"))
    again.setup("fit")
    assert again._captions.layout == dm._captions.layout
    for key in expected:
        assert torch.equal(again._captions.empty[key], dm._captions.empty[key])


def test_dropout_and_guidance_put_the_empty_caption_in_a_dropped_caption_s_place_and_keep_the_size_conditions():
    objective = FlowMatching(condition_dropout=0.5)
    objective.bind("latent", "label")
    captions = {"hidden": torch.randn(64, 3, 4), "pooled": torch.randn(64, 5), "time_ids": torch.randn(64, 6)}
    empty = {"hidden": torch.full((1, 3, 4), 7.0), "pooled": torch.full((1, 5), 7.0)}
    batch = {"latent": torch.zeros(64, 4, 2, 2), "caption_embedding": captions, "caption_embedding_empty": empty}
    torch.manual_seed(0)
    got = objective.condition_of(batch, train=True)
    dropped = (got["hidden"] == 7.0).flatten(1).all(1)
    assert 10 < int(dropped.sum()) < 54, "about half the captions dropped"
    assert torch.equal((got["pooled"] == 7.0).all(1), dropped), "a caption's fields are dropped together"
    assert torch.equal(got["hidden"][~dropped], captions["hidden"][~dropped])
    assert torch.equal(got["time_ids"], captions["time_ids"]), "the size conditions are never dropped"
    assert objective.condition_of(batch, train=False) is captions

    null = null_condition(objective, captions, empty)
    assert (null["hidden"] == 7.0).all() and (null["pooled"] == 7.0).all()
    assert torch.equal(null["time_ids"], captions["time_ids"])
    zeros = null_condition(objective, captions)  # no empty caption: zeros, as for one-tensor captions
    assert not zeros["hidden"].any() and not zeros["time_ids"].any()


def test_a_cache_without_its_empty_caption_or_with_a_damaged_one_is_one_line(folders, shapes, tmp_path):
    dm = data_module(shapes, _cache(tmp_path, folders["pixart"]))
    dm.setup("fit")
    folder = tmp_path / "cache" / "caption_encoder" / FOLDER
    (path,) = folder.iterdir()
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match=rf"{path.name} is damaged .*run `lit-dist cache --config <this config>`"):
        data_module(shapes, _cache(tmp_path, folders["pixart"], mode="read")).setup("fit")
    os.remove(path)
    with pytest.raises(DataError, match=rf"lacks caption_encoder/empty/{path.name}, the empty caption"):
        data_module(shapes, _cache(tmp_path, folders["pixart"], mode="read")).setup("fit")
    data_module(shapes, _cache(tmp_path, folders["pixart"])).setup("fit")  # a build writes it again
    assert path.exists()


class _Fields(torch.nn.Module):
    """A caption encoder of two fields whose token count follows the longest caption (a batch-dependent shape)."""

    def __init__(self, empty: bool = True):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        if empty:
            self.empty_caption = lambda: self([""])

    def forward(self, texts):
        n = max(len(t) for t in texts) // 8 + 1
        return {"hidden": torch.ones(len(texts), n, 2) * self.scale, "pooled": torch.ones(len(texts), 3)}


def test_a_dict_encoder_needs_its_empty_caption_and_one_shape(monkeypatch, shapes, tmp_path):
    import tests.unit.test_pipeline_caption_cache as here

    spec = {"class_path": f"{here.__name__}._Fields", "init_args": {}}
    # Per batch of distinct captions (a repeated caption is encoded once).
    with pytest.raises(ConfigError, match=r"returned \{'hidden': \((\d+), 6, 2\), 'pooled': \(\1, 3\)\} for \1 captions, "
                                          r"and hidden \[1, 2\], pooled \[3\] per caption for the empty caption"):
        data_module(shapes, _cache(tmp_path, "", caption_encoder=spec)).setup("fit")
    spec = {"class_path": f"{here.__name__}._Fields", "init_args": {"empty": False}}
    with pytest.raises(ConfigError, match=r"returns a dict without saying what stands for no caption: give it a "
                                          r"method empty_caption\(\)"):
        data_module(shapes, _cache(tmp_path / "b", "", caption_encoder=spec)).setup("fit")


def test_a_layout_flattens_and_unflattens_every_field():
    fields = {"pooled": torch.randn(2, 3), "hidden": torch.randn(2, 4, 5), "mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}
    layout = Layout.of(fields)
    assert layout.fields == (("hidden", (4, 5)), ("mask", (3,)), ("pooled", (3,))) and layout.width == 26
    back = layout.unflatten(layout.flatten(fields))
    for key, value in fields.items():
        assert torch.equal(back[key], value.float())


def test_a_complete_cache_is_read_without_loading_its_encoders(monkeypatch, folders, shapes, tmp_path):
    from lit_dist.cache.encoders import VAEEncoder

    cache = _cache(tmp_path, folders["sdxl"], encoder={"class_path": "lit_dist.cache.encoders.VAEEncoder",
                                                      "init_args": {"pretrained": folders["sdxl"], "subfolder": "vae"}})
    data_module(shapes, cache).setup("fit")  # built: both encoders ran

    def refuse(*args, **kwargs):
        raise AssertionError("an encoder was loaded for a cache that holds every entry")

    monkeypatch.setattr(PipelineTextEncoder, "__init__", refuse)
    monkeypatch.setattr(VAEEncoder, "__init__", refuse)
    for mode in ("read", "build"):
        dm = data_module(shapes, _cache(tmp_path, folders["sdxl"], mode=mode, encoder=cache.encoder))
        dm.setup("fit")
        assert set(_batch(dm)["caption_embedding"]) == {"hidden", "pooled"}


@pytest.fixture(scope="module")
def odd_sizes(tmp_path_factory):
    """Six captioned images of three sizes, none of its bucket's shape: each is resized and cropped."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    root = tmp_path_factory.mktemp("odd")
    rng = np.random.default_rng(0)
    sizes = [(70, 38), (38, 90), (53, 47)] * 2  # (width, height)
    names = []
    for i, (w, h) in enumerate(sizes):
        names.append(f"{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / names[-1])
    pq.write_table(pa.table({"filename": names, "width": [w for w, _ in sizes], "height": [h for _, h in sizes],
                             "caption": [f"image {i}" for i in range(6)], "split": ["train"] * 6}),
                   root / "metadata.parquet")
    return root / "metadata.parquet"


@pytest.mark.parametrize("cached", ["pixels", "latents"])
def test_sdxl_s_size_conditions_are_each_image_s_own_size_and_crop(cached, folders, odd_sizes, tmp_path):
    """time_ids = (original height, width, crop top, left, bucket height, width), the crop being where the image
    (random crop, from a pixel cache) or the cached latents (the centre crop) were taken from the image resized to
    cover its bucket."""
    import numpy as np
    import pyarrow.parquet as pq

    vae = {"class_path": "lit_dist.cache.encoders.VAEEncoder",
           "init_args": {"pretrained": folders["sdxl"], "subfolder": "vae"}}
    cache = _cache(tmp_path, folders["sdxl"], **({"pixels": False, "encoder": vae} if cached == "latents" else {}))
    dm = data_module(odd_sizes, cache, size_conditions=True, batch_size_per_device=1, random_crop=True, alignment=16)
    dm.setup("fit")
    table = pq.read_table(odd_sizes).to_pydict()
    dataset = dm._splits["train"]
    seen = 0
    for raw in dm.train_dataloader():
        batch = dm.on_after_batch_transfer(raw, 0)
        time_ids = batch["caption_embedding"]["time_ids"]
        row = int(batch["row"][0])
        index = int(np.flatnonzero(dataset.rows == row)[0])
        h, w = (int(v) for v in time_ids[0, 4:])
        covering = dataset.covering(index, w, h)  # decoded here: the crop's frame, found independently
        top, left = int(time_ids[0, 2]), int(time_ids[0, 3])
        assert time_ids[0, :2].tolist() == [table["height"][row], table["width"][row]]
        if cached == "pixels":
            expected = covering[top : top + h, left : left + w]
            image = (batch["image"][0] * 0.5 + 0.5) * 255  # the data module's normalisation, undone
            assert np.abs(image.permute(1, 2, 0).numpy() - expected).max() < 1e-3
        else:
            assert (top, left) == ((covering.shape[0] - h) // 2, (covering.shape[1] - w) // 2)
            latent_h, latent_w = batch["latent"].shape[-2:]
            assert h * latent_w == w * latent_h, "the target size is the bucket the latents were made at"
        seen += 1
    assert seen == 6
    with pytest.raises(ConfigError, match="data.size_conditions = true .* caches none: set pipeline.path"):
        data_module(odd_sizes, None, size_conditions=True)


def test_encoders_run_in_the_compute_dtype_and_it_keys_the_cache(folders, shapes, tmp_path):
    """data.cache.compute_dtype bf16: the VAE and the text encoders cache in bf16 (half their memory), their entries
    keyed apart from fp32's, and within bf16's rounding of them."""
    vae = {"class_path": "lit_dist.cache.encoders.VAEEncoder",
           "init_args": {"pretrained": folders["sdxl"], "subfolder": "vae"}}
    batches, plans = {}, {}
    for dtype in ("fp32", "bf16"):
        dm = data_module(shapes, _cache(tmp_path, folders["sdxl"], pixels=False, encoder=vae, compute_dtype=dtype,
                                        encoder_dtype="fp32"))
        dm.setup("fit")
        batches[dtype], plans[dtype] = _batch(dm), dm.cache_plan(dm.read())
    assert plans["fp32"].fingerprints.keys() == plans["bf16"].fingerprints.keys()
    for name, fingerprint in plans["fp32"].fingerprints.items():
        assert plans["bf16"].fingerprints[name] != fingerprint, f"{name}: a bf16 encoder's entries are other entries"
    for name in ("encoder", "caption_encoder"):
        weights = {p.dtype for p in plans["bf16"]._load(name).parameters()}
        assert weights == {torch.bfloat16}, (name, weights)
    assert not torch.equal(batches["fp32"]["latent"], batches["bf16"]["latent"])
    torch.testing.assert_close(batches["bf16"]["latent"], batches["fp32"]["latent"], rtol=0.05, atol=0.05)
    for key, value in batches["fp32"]["caption_embedding"].items():
        torch.testing.assert_close(batches["bf16"]["caption_embedding"][key], value, rtol=0.05, atol=0.05, msg=key)
