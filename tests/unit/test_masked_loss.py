"""Loss masks (lit_dist/reading/masks.py): from a mask column or the images' alpha, resized and cropped with their
images, cached beside latents on the encoder's grid, and the loss averaged over the pixels they weigh."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.nn import functional as F

from lit_dist.cache.store import CacheStore
from lit_dist.data.datamodule import BucketDataModule
from lit_dist.data.sources import DatasetSource
from lit_dist.errors import ConfigError, DataError
from lit_dist.model.objectives import Diffusion, FlowMatching, loss_mask
from tests.helpers.cache import data_module, identity_table
from tests.helpers.masks import masked_copy, red
from tests.unit.test_cache import batches, cache_config

pytestmark = pytest.mark.unit


@pytest.fixture
def data(tmp_path):
    """120 demo images, their table with bytes and mtime columns (a cache keys on them); returns the table path."""
    return identity_table(tmp_path)


@pytest.mark.parametrize("how", ["column", "alpha"])
def test_each_mask_is_resized_and_cropped_with_its_image(tmp_path, data, how):
    table = masked_copy(data, tmp_path / "masked", how, unmasked_every=5)
    knob = {"mask_column": "mask"} if how == "column" else {"alpha_mask": True}
    dm = data_module(table, None, **knob)
    dm.setup("fit")
    got = batches(dm, "train", 12) + batches(dm, "val", 4)
    unmasked = masked = 0
    for batch in got:
        assert batch["mask"].dtype == torch.uint8 and batch["mask"].shape == batch["image"].shape[:3]
        for image, mask, row in zip(batch["image"], batch["mask"], batch["row"], strict=True):
            if int(row) % 5 == 0:  # no mask: every pixel counts
                assert bool((mask == 255).all())
                unmasked += 1
            else:  # its red channel, resized alike and cropped at the same random offset
                assert np.array_equal(mask.numpy(), red(image)), int(row)
                masked += 1
    assert masked > 50 and unmasked > 5
    # The images themselves are those of the same table without masks, crop for crop.
    plain = data_module(table, None)
    plain.setup("fit")
    for a, b in zip(got[:12], batches(plain, "train", 12), strict=True):
        assert torch.equal(a["image"], b["image"]) and "mask" not in b


def test_a_latent_cache_keeps_each_mask_on_the_encoders_grid_and_a_changed_mask_is_rebuilt(tmp_path, data):
    table = masked_copy(data, tmp_path / "masked", "column")
    cfg = dict(pixels=False, encoder_dtype="fp32")
    cached = data_module(table, cache_config(tmp_path, **cfg), mask_column="mask")
    cached.setup("fit")
    plain = data_module(table, None, mask_column="mask", random_crop=False)
    plain.setup("fit")
    for a, b in zip(batches(cached, "val", 4), batches(plain, "val", 4), strict=True):
        assert "image" not in a and a["mask"].dtype == torch.uint8
        assert a["mask"].shape == (len(a["latent"]), *a["latent"].shape[2:])  # the latents' grid (1/8 a side)
        expected = F.adaptive_avg_pool2d(b["mask"].float()[:, None], a["latent"].shape[2:])[:, 0].round()
        assert torch.equal(a["mask"].float(), expected)
    # One mask file changes: its entry alone is stale; the encoder's entries stay.
    name = pq.read_table(table).column("mask")[4].as_py()
    from PIL import Image

    before = Image.open(table.parent / name)
    Image.new("L", before.size, 0).save(table.parent / name)
    with pytest.raises(DataError, match=r"mask: 119 of 120 cached.*1 missing \(1 of them stale\)"):
        data_module(table, cache_config(tmp_path, mode="read", **cfg), mask_column="mask").setup("fit")
    _, report = data_module(table, cache_config(tmp_path, **cfg), mask_column="mask").build_cache(torch.device("cpu"))
    assert report["samples"] == 1
    again = data_module(table, cache_config(tmp_path, mode="read", **cfg), mask_column="mask")
    again.setup("fit")
    view = again._cache_views[0]["mask"]
    assert not view.read(4).any() and view.read(5).any()


def test_masks_added_to_a_latent_cache_are_built_alone_and_a_dataset_without_masks_counts_everywhere(tmp_path, data):
    table = masked_copy(data, tmp_path / "masked", "alpha")
    cfg = dict(pixels=False, encoder_dtype="fp32")
    data_module(table, cache_config(tmp_path, **cfg)).setup("fit")  # latents only
    store = CacheStore(str(tmp_path / "cache"))
    latents = store.manifest("encoder")["shards"]
    dm = data_module(table, cache_config(tmp_path, **cfg), alpha_mask=True)
    plan, report = dm.build_cache(torch.device("cpu"))
    assert plan.fields == ["encoder", "mask"] and report["samples"] == 120 and report["shards"] == 1
    assert store.manifest("encoder")["shards"] == latents  # the latents were kept, not encoded again
    # Two datasets, one with masks: the other's batches carry masks too, all 255.
    mixed = BucketDataModule(datasets=[DatasetSource(metadata=str(table), alpha_mask=True),
                                       DatasetSource(metadata=str(data))],
                             resolution=32, batch_size_per_device=8, num_workers=0, seed=3,
                             allow_oversubscription=True, cache=cache_config(tmp_path, **cfg))
    mixed.setup("fit")
    seen = set()
    for batch in batches(mixed, "train", 16):
        part = int(batch["dataset"][0])
        seen.add(part)
        # The dataset without masks: every cell 255; the other's masks are its images' red channels, on the grid.
        assert bool((batch["mask"] == 255).all()) == (part == 1), part
    assert seen == {0, 1}


def test_a_missing_mask_file_makes_its_sample_bad_replaced_and_counted(tmp_path, data):
    table = masked_copy(data, tmp_path / "masked", "column")
    name = pq.read_table(table).column("mask")[3].as_py()
    (table.parent / name).unlink()
    dm = data_module(table, None, mask_column="mask", random_crop=False)
    dm.setup("fit")
    got = batches(dm, "train", 30) + batches(dm, "val", 30)
    assert sum(int(b["bad_samples"]) for b in got) >= 1
    assert all(3 not in b["row"].tolist() for b in got)


def test_the_masked_loss_is_the_mean_over_the_pixels_the_mask_weighs():
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 3, 1)  # pixel by pixel: what lies outside the mask cannot reach a pixel inside it
    denoiser = lambda x, t, c: net(x)  # noqa: E731
    x0, noise = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    t = torch.rand(4)
    mask = torch.zeros(4, 8, 8, dtype=torch.uint8)
    mask[:, 2:6, 1:7] = 255
    mask[1] = 0  # a sample whose mask is empty: loss 0, never 0 / 0
    mask[2, 0, 0] = 128  # grey: counts in part
    weights = loss_mask(mask, x0)
    for objective in (FlowMatching(condition="none"), Diffusion(condition="none")):
        got = objective.per_sample_loss(denoiser, x0, noise, t, None, mask=weights)
        unmasked = objective.per_sample_loss(denoiser, x0, noise, t, None)
        assert got[1] == 0 and torch.isfinite(got).all()
        # An all-255 mask is the plain mean.
        torch.testing.assert_close(objective.per_sample_loss(denoiser, x0, noise, t, None,
                                                             mask=loss_mask(torch.full_like(mask, 255), x0)), unmasked)
        # What lies outside the mask changes neither the loss nor the gradient.
        outside = x0.clone()
        outside[:, :, :, 7] += 5.0
        outside[:, :, 0, 1:] -= 3.0
        grads, losses = [], []
        for inputs in (x0, outside):
            net.zero_grad()
            losses.append(objective.per_sample_loss(denoiser, inputs, noise, t, None, mask=weights))
            losses[-1].sum().backward()
            grads.append(net.weight.grad.clone())
        torch.testing.assert_close(losses[0], losses[1])
        torch.testing.assert_close(grads[0], grads[1])
        assert not torch.equal(objective.per_sample_loss(denoiser, outside, noise, t, None), unmasked)  # unmasked: it does
    # The reference (flow matching's velocity target): kohya's apply_masked_loss weighs the squared errors by the mask,
    # here averaged over what it weighs.
    s = FlowMatching(condition="none").noise_level(t, x0).view(-1, 1, 1, 1)
    with torch.no_grad():
        per_pixel = (net((1 - s) * x0 + s * noise) - (noise - x0)) ** 2
        w = (mask.float() / 255)[:, None].expand_as(per_pixel)
        expected = (per_pixel * w).flatten(1).sum(1) / w.flatten(1).sum(1).clamp_min(1e-12)
        torch.testing.assert_close(FlowMatching(condition="none").per_sample_loss(denoiser, x0, noise, t, None,
                                                                                 mask=weights), expected)


def test_a_mask_is_averaged_onto_the_inputs_grid():
    mask = torch.zeros(2, 16, 16, dtype=torch.uint8)
    mask[:, :8] = 255
    weights = loss_mask(mask, torch.zeros(2, 4, 4, 4))
    assert weights.shape == (2, 1, 4, 4) and torch.equal(weights[:, 0, :2], torch.ones(2, 2, 4))
    assert torch.equal(weights[:, 0, 2:], torch.zeros(2, 2, 4))
    assert loss_mask(None, torch.zeros(1)) is None


def test_a_classifier_refuses_masks_it_cannot_use():
    from lit_dist.model.objectives import Classification

    batch = {"image": torch.zeros(2, 3, 8, 8), "label": torch.zeros(2, dtype=torch.long),
             "mask": torch.zeros(2, 8, 8, dtype=torch.uint8)}
    objective = Classification()
    objective.bind("image", "label")
    with pytest.raises(ConfigError, match=r"loss masks .* and model.objective is Classification"):
        objective.loss(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4)), batch, train=True)


def test_mask_settings_that_cannot_work_are_refused_in_one_line(tmp_path, data):
    with pytest.raises(ConfigError, match=r"data.mask_column = 'mask' and data.alpha_mask = true"):
        data_module(data, None, mask_column="mask", alpha_mask=True)
    with pytest.raises(ConfigError, match=r"data.datasets\[0\].mask_column = 'm' names mask files in a metadata"):
        BucketDataModule(datasets=[DatasetSource(scan_root=str(data.parent), mask_column="m")])
    with pytest.raises(ConfigError, match=r"data has loss masks, and data.cache.pixels is true"):
        data_module(data, cache_config(tmp_path), alpha_mask=True)
    with pytest.raises(ConfigError, match=r"data.cache.mode is ondemand, which makes no masks"):
        data_module(data, cache_config(tmp_path, pixels=False, mode="ondemand"), alpha_mask=True)
    with pytest.raises(DataError, match=r"mask_column = 'masks': .* has no such column"):
        data_module(data, None, mask_column="masks").setup("fit")
    table = pq.read_table(data)
    pq.write_table(table.append_column("mask", pa.array(range(len(table)))), data)
    with pytest.raises(DataError, match=r"mask_column 'mask' has type int64; it must hold paths"):
        data_module(data, None, mask_column="mask").setup("fit")
    pooled = {"class_path": "tests.helpers.encoders.PooledEncoder"}
    with pytest.raises(ConfigError, match=r"returns \(3,\) per image, and the data has loss masks"):
        data_module(data, cache_config(tmp_path, pixels=False, encoder=pooled), alpha_mask=True).setup("fit")


def test_a_masked_run_resumes_bitwise_and_learns_other_weights_than_an_unmasked_one(tmp_path, demo_data):
    from tests.helpers.training import run

    table = masked_copy(demo_data, tmp_path / "masked", "column")

    def objective():  # labels as the condition (null label 4 for the dropped ones)
        return FlowMatching(condition="label", null_label=4)

    stop, end = 4, 7
    masked = {"mask_column": "mask"}
    straight, _, _ = run(tmp_path / "a", table, max_steps=end, objective=objective(), data=masked)
    run(tmp_path / "b", table, max_steps=end, stop=stop, objective=objective(), data=masked)
    resumed, _, _ = run(tmp_path / "b", table, max_steps=end, resume=True, objective=objective(), data=masked)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after resume"
    unmasked, _, _ = run(tmp_path / "c", table, max_steps=end, objective=objective())
    assert any(not torch.equal(a, b) for a, b in zip(straight.state_dict().values(), unmasked.state_dict().values(),
                                                     strict=True))


def test_a_mask_of_its_images_size_is_taken_whatever_the_rounding_and_another_aspect_is_a_bad_sample():
    import io

    from PIL import Image

    from lit_dist.reading.crops import covering_size
    from lit_dist.reading.decode import covering_mask
    from lit_dist.reading.unreadable import BadImage

    def png(width, height):
        out = io.BytesIO()
        Image.new("L", (width, height), 200).save(out, format="PNG")
        return out.getvalue()

    size = covering_size(49, 80, 24, 40)  # (24, 40): rounding moved the aspect ratio by 2 %
    assert size == (24, 40)
    assert covering_mask(png(49, 80), size).shape == (40, 24)
    with pytest.raises(BadImage, match=r"its mask is 80x80, of another aspect ratio"):
        covering_mask(png(80, 80), size)
