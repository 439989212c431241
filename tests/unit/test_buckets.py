import numpy as np
import pytest

from lit_dist.data.buckets import assign_buckets, make_buckets
from lit_dist.errors import ConfigError


@pytest.mark.parametrize("resolution,alignment,max_aspect", [(32, 8, 2.0), (256, 64, 2.0), (512, 64, 4.0), (1024, 64, 1.0)])
def test_buckets_are_aligned_integer_sizes_of_about_the_target_area(resolution, alignment, max_aspect):
    buckets = make_buckets(resolution, alignment, max_aspect)
    assert buckets.dtype == np.int64 and buckets.shape[1] == 2
    assert (buckets % alignment == 0).all()
    aspect = buckets[:, 0] / buckets[:, 1]
    assert (np.maximum(aspect, 1 / aspect) <= max_aspect + 1e-9).all()
    assert (np.diff(aspect) > 0).all(), "sorted by aspect, no duplicates"
    area = buckets.prod(axis=1) / resolution**2
    assert ((area > 0.6) & (area < 1.5)).all()
    assert [resolution, resolution] in buckets.tolist()


def test_each_image_goes_to_the_bucket_of_nearest_aspect():
    buckets = make_buckets(256, 64, 2.0)
    widths = np.array([1000, 500, 2000, 300, 1920])
    heights = np.array([1000, 1000, 1000, 900, 1080])
    chosen = buckets[assign_buckets(widths, heights, buckets)]
    for (w, h), (bw, bh) in zip(zip(widths, heights, strict=True), chosen, strict=True):
        distances = np.abs(np.log(buckets[:, 0] / buckets[:, 1]) - np.log(w / h))
        assert np.isclose(abs(np.log(bw / bh) - np.log(w / h)), distances.min())


def test_bad_bucket_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        make_buckets(0, -8, 0.5)
    message = str(err.value)
    assert "3 problems" in message
    assert "data.resolution = 0" in message and "data.alignment = -8" in message and "data.max_aspect = 0.5" in message
