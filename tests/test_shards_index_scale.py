"""A shard index loads without holding every key as a Python object: each shard's lists are made compact as the
JSON is parsed, and a key is decoded only when asked for."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from fastfeed.io.shards.index import Keys, ShardIndex

N_SHARDS, PER_SHARD = 200, 1000


@pytest.fixture(scope="module")
def big_index(tmp_path_factory):
    path = tmp_path_factory.mktemp("index") / "fastfeed-index.json"
    doc = {"format": "fastfeed-shard-index", "version": 1, "shards": [
        # 10**9: each shard's 1000 samples (512 + ~100.5 MB) must fit its size, which the reader checks.
        {"url": f"shard-{k:06d}.tar", "size": 10**9, "crc32": k, "first": 512,
         "lengths": [100_000 + i for i in range(PER_SHARD)], "keys": [f"{k:06d}{i:09d}" for i in range(PER_SHARD)]}
        for k in range(N_SHARDS)]}  # fmt: skip
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path


def test_a_large_index_loads_in_a_few_bytes_per_sample_beyond_its_arrays(big_index):
    """200,000 samples: the load's peak is at most 150 bytes a sample (the file's text, its decoded str and the
    arrays kept: offsets, key boundaries, key bytes, ~100 bytes); parsed into lists of Python objects, every key a
    str and every length an int, it was 330. The keys and byte ranges are the file's."""
    tracemalloc.start()
    try:
        index = ShardIndex.load(str(big_index))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    n = N_SHARDS * PER_SHARD
    assert index.n_samples == n and peak / n <= 150, f"{peak / n:.0f} bytes a sample at the load's peak"
    assert index.key(0) == "000000000000000" and index.key(n - 1) == f"{N_SHARDS - 1:06d}{PER_SHARD - 1:09d}"
    k, start, end = index.locate(PER_SHARD + 3)
    assert (k, start, end) == (1, 512 + 3 * 100_000 + 3, 512 + 4 * 100_000 + 6)
    assert not any(isinstance(v, list) and len(v) >= n for v in vars(index).values())


def test_a_subset_keeps_its_shards_keys_and_ranges_without_decoding_them(big_index):
    """subset() slices the key bytes and offsets of the shards it keeps, in the order asked."""
    index = ShardIndex.load(str(big_index))
    urls = [index.urls[7], index.urls[2]]
    sub = index.subset(urls)
    assert sub.urls == urls and sub.n_samples == 2 * PER_SHARD
    assert sub.shard_keys(0) == index.shard_keys(7) and sub.shard_keys(1) == index.shard_keys(2)
    assert np.array_equal(sub.shard_offsets(1), index.shard_offsets(2))
    assert sub == ShardIndex.from_shards([{"url": u, "size": 10**9, "crc32": c, "keys": index.shard_keys(k),
                                           "offsets": index.shard_offsets(k)} for u, c, k in ((urls[0], 7, 7),
                                                                                               (urls[1], 2, 2))])


@pytest.mark.parametrize("shard,why", [
    ({"url": "a.tar", "size": 1, "crc32": 0, "first": 0, "lengths": [1], "keys": [5]}, "keys must be strings"),
    ({"url": "a.tar", "size": 1, "crc32": 0, "first": 0, "lengths": ["x"], "keys": ["k"]}, "lengths integers"),
    ({"url": "a.tar", "size": 1, "crc32": 0, "first": 0, "lengths": 3, "keys": "k"}, "must be lists"),
    ([1, 2], "must be an object, not list"),
])  # fmt: skip
def test_a_damaged_shard_entry_is_named_as_such(tmp_path, shard, why):
    """Keys that are not strings, lengths that are not integers, entries that are not objects: a ValueError
    naming the index as damaged, never an AttributeError from inside the parser."""
    path = tmp_path / "fastfeed-index.json"
    path.write_text(json.dumps({"format": "fastfeed-shard-index", "version": 1, "shards": [shard]}))
    with pytest.raises(ValueError, match=f"damaged shard index .*{why}"):
        ShardIndex.load(str(path))


def test_keys_round_trip_any_text():
    """Keys of any text (non-ASCII, undecodable bytes kept as surrogates) come back as given."""
    keys = ["a", "é/ü", "", "x\udcff"]
    joined = Keys.join([Keys.of(keys[:2]), Keys.of(keys[2:])])
    index = ShardIndex(["s.tar"], [10], [0], [4], np.arange(5), joined)
    assert [index.key(i) for i in range(4)] == keys
