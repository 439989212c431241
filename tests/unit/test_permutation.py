"""Keyed permutations evaluated at chosen positions: bijective, deterministic, and well mixed."""

import numpy as np
import pytest

from lit_dist.data.permutation import MATERIALISE_BELOW, permute

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [1, 2, 37, MATERIALISE_BELOW, MATERIALISE_BELOW + 1, 3 * MATERIALISE_BELOW + 5])
def test_a_bijection_whose_parts_agree_with_the_whole(n):
    whole = permute(np.arange(n), n, (7, 1))
    assert np.array_equal(np.sort(whole), np.arange(n))
    some = np.random.default_rng(0).choice(n, size=min(n, 500), replace=False)
    assert np.array_equal(permute(some, n, (7, 1)), whole[some])
    assert np.array_equal(permute(np.arange(n), n, (7, 1)), whole), "not deterministic"
    if n > 2:
        assert not np.array_equal(permute(np.arange(n), n, (7, 2)), whole), "the key is ignored"


def test_large_domains_are_shuffled_evenly():
    n = 4 * MATERIALISE_BELOW + 3
    # Where position 0 lands over many keys: uniform over n, so its deciles are about equally full.
    landed = np.array([permute(np.array([0]), n, (seed,))[0] for seed in range(2000)])
    deciles = np.bincount(landed * 10 // n, minlength=10)
    assert deciles.min() > 140 and deciles.max() < 260, deciles
    # Neighbouring positions do not stay neighbours: consecutive images are far apart on average.
    whole = permute(np.arange(n), n, (3,))
    assert abs(np.abs(np.diff(whole)).mean() / n - 1 / 3) < 0.02  # |U - V| of independent uniforms averages 1/3
    # Nor does the permutation keep order: about half of all consecutive pairs ascend.
    assert abs((np.diff(whole) > 0).mean() - 0.5) < 0.01
