"""splitmix64's constants: the one home of the odd 64-bit numbers every hash in lit-dist multiplies by.

splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014; Vigna's
reference code) adds ``GOLDEN_GAMMA`` to its state per output and finishes it with two multiply-xorshift
rounds::

    z = (z ^ (z >> 30)) * MIX1
    z = (z ^ (z >> 27)) * MIX2
    z = z ^ (z >> 31)

after which every input bit affects every output bit. Users: file name hashes (``reading/names.py``), cache
keys (``cache/keys.py``), random crops and tag orders (``sample_word``), the Feistel rounds of shuffles
(``data/permutation.py``). Their results are stored (cache keys) or must repeat across runs and resumes
(crops, shuffles): these values never change.
"""

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, made odd
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1  # Python ints do not wrap: products are reduced modulo 2**64 with it


def sample_word(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """A 64-bit random word from (seed, epoch, index) alone, one independent ``stream`` per use (0: the crop's
    offsets, 1: a caption's tag order): a resumed or re-sharded run draws the same for a sample. Under 1 us, where a
    generator per sample (``np.random.default_rng([seed, epoch, index])``) costs 12-25 us."""
    # 0xD1B5...: one more odd constant, so that seed, epoch, index and stream each have their own multiplier.
    word = (seed * GOLDEN_GAMMA + epoch * 0xD1B54A32D192ED03 + index * MIX1 + stream * MIX2) & MASK64
    word = ((word ^ (word >> 30)) * MIX1) & MASK64
    word = ((word ^ (word >> 27)) * MIX2) & MASK64
    return word ^ (word >> 31)
