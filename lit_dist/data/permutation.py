"""Random permutations evaluated at chosen positions only.

A rank needs just its slice of each epoch's shuffle: 1/world of it. Shuffling all
samples on every rank costs O(n) per epoch (a second at 10 M samples, on every
rank of every node); evaluating a keyed bijection at the rank's positions costs
O(n / world). The bijection is a Feistel network over [0, 2**bits), restricted
to [0, n) by cycle walking (re-encrypting values that land outside), keyed from
(seed, epoch, ...) through numpy's SeedSequence: the same on every rank, run
and machine. Grain's ``index_shuffle`` uses the same construction.

Small domains, where a materialised permutation is cheap, use numpy's own
``permutation`` instead: its statistical quality is the reference.
"""

from collections.abc import Sequence

import numpy as np

from lit_dist.reading.hashing import MIX1, MIX2

ROUNDS = 4  # Luby-Rackoff: 4 rounds of a good round function give a pseudo-random permutation
MATERIALISE_BELOW = 1 << 16


def permute(positions: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """The elements at ``positions`` (ints in [0, n)) of the random permutation of range(n) that ``key`` names."""
    positions = np.asarray(positions)
    if n <= MATERIALISE_BELOW:
        return np.random.default_rng(list(key)).permutation(n)[positions]
    bits = (n - 1).bit_length()
    bits += bits & 1  # two equal halves
    if bits > 64:
        raise ValueError(f"cannot permute {n} elements (at most 2**64)")
    wide = bits > 32
    dtype = np.uint64 if wide else np.uint32
    keys = np.random.SeedSequence(list(key)).generate_state(ROUNDS, dtype)
    half = dtype(bits // 2)
    mask = dtype((1 << (bits // 2)) - 1)
    # Multiply-xorshift round function (murmur3's finaliser, and splitmix64's for 64 bits).
    m1, m2, s1, s2 = ((MIX1, MIX2, 31, 29) if wide else (0x85EBCA6B, 0xC2B2AE35, 16, 13))
    m1, m2, s1, s2 = dtype(m1), dtype(m2), dtype(s1), dtype(s2)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for k in keys:
            z = right ^ k
            z *= m1
            z ^= z >> s1
            z *= m2
            z ^= z >> s2
            z &= mask
            z ^= left
            left, right = right, z
        return (left << half) | right

    out = encrypt(positions.astype(dtype))
    outside = np.flatnonzero(out >= n)
    while len(outside):  # 2**bits < 4 n: on average fewer than 4 rounds of walking, most values need none
        out[outside] = encrypt(out[outside])
        outside = outside[out[outside] >= n]
    return out.astype(np.int64)


def permute_blocks(positions: np.ndarray, n: int, block: int, key: Sequence[int]) -> np.ndarray:
    """The elements at ``positions`` of a shuffle of range(n) that moves runs of ``block`` consecutive elements
    together: the runs are shuffled (``permute`` over them), each keeps its order, and where they start shifts
    with ``key`` (so the same neighbours are not grouped every time). The last, shorter run comes last."""
    positions = np.asarray(positions, dtype=np.int64)
    if n == 0:
        return positions
    full = n // block
    phase = int(np.random.default_rng([*key, 1]).integers(block))
    slot, within = np.divmod(positions, block)
    start = np.full(len(positions), full * block, dtype=np.int64)  # the shorter run's slot and place: the last
    whole = slot < full
    if full:
        start[whole] = permute(slot[whole], full, key) * block
    return (start + within + phase) % n
