"""The hashes built on splitmix64's constants (lit_dist/reading/hashing.py) give exactly the values they always gave.

Cache keys are stored in caches on disk, and crops and shuffles must repeat across runs and resumes: any
change to these numbers turns every existing cache stale and changes the data a resumed run sees.
"""

import numpy as np
import pyarrow as pa

from lit_dist.cache.keys import entry_keys, identity_hash, sample_ids
from lit_dist.data.permutation import permute
from lit_dist.reading.crops import crop_offsets
from lit_dist.reading.names import name_hashes

NAMES = pa.array(["", "a", "photos/x.jpg"])


def test_name_hashes_and_cache_keys_keep_their_values():
    assert name_hashes(NAMES).tolist() == [0, 1221782590894170935, 14200669766772585173]
    assert sample_ids(NAMES, "s3://bucket/root/").tolist() == [16345111053869283434, 12751109302082486757,
                                                               11510979391588469915]
    identity = identity_hash(np.arange(3) * 1000 + 17, np.linspace(1.7e9, 1.8e9, 5)[:3])
    keys = entry_keys(sample_ids(NAMES, "/data"), identity, np.array([[32, 48]] * 3), "fp")
    assert keys.tolist() == [3412088432344452311, 17900870711117895078, 6107443769911018287]


def test_crops_and_shuffles_keep_their_values():
    assert [crop_offsets(0, 0, i, 37, 91) for i in range(3)] == [(0, 0), (27, 38), (22, 87)]
    assert permute(np.arange(0, 3 * 997, 997), (1 << 40) + 123, [3, 1]).tolist() == [1060726607971, 409697065552,
                                                                                      490053342333]
    assert permute(np.arange(0, 3 * 37, 37), (1 << 17) + 5, [2, 9]).tolist() == [73926, 122747, 41946]
