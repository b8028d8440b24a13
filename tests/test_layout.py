"""How batches are laid into slot memory and read back (fastfeed._ring.layout), in one process."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils.data import default_collate

from fastfeed._ring import layout

Point = collections.namedtuple("Point", "x y")


def _round_trip(batch_samples, collate=layout.slot_collate):
    payload, objs, leaves, nbytes = layout.plan(collate(batch_samples))
    base = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    layout.fill(base, objs, leaves)
    return layout.unpack(payload, leaves, base if nbytes else None)


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16])
def test_large_samples_take_the_gather_path_and_match_default_collate(dtype):
    """Samples above the gather threshold come back equal to default_collate's batch, for every dtype."""
    n = layout.GATHER_MIN_SAMPLE_BYTES // torch.tensor([], dtype=dtype).element_size() + 5
    samples = [(torch.rand(n) * 100).to(dtype) for _ in range(4)]
    assert samples[0].nbytes >= layout.GATHER_MIN_SAMPLE_BYTES
    _assert_same(_round_trip(samples), default_collate(samples))


def test_non_contiguous_and_mixed_dtype_samples_fall_back_to_torch_stack():
    """A strided sample or one of another dtype is stacked by torch, which casts as default_collate does."""
    big = torch.arange(2 * 8192, dtype=torch.float32).view(8192, 2)
    samples = [big[:, 0].clone(), big[:, 1], big[:, 0].to(torch.float64)]  # contiguous, strided, float64
    assert not samples[1].is_contiguous()
    out = _round_trip(samples)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.stack([s.to(torch.float32) for s in samples]))


def test_large_samples_that_require_grad_raise_as_in_torchs_workers():
    """Samples requiring grad cannot be stacked into slot memory, whatever their size: torch.stack's out= error."""
    samples = [torch.ones(layout.GATHER_MIN_SAMPLE_BYTES, requires_grad=True) for _ in range(2)]
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        _round_trip(samples)


def test_mismatched_shapes_raise_torchs_stack_error():
    """Samples of different shapes raise the same error as torch.stack, not a crash or silent garbage."""
    samples = [torch.zeros(9000), torch.zeros(9001)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        _round_trip(samples)


def test_nested_structures_keep_their_types():
    """Dicts, namedtuples, lists, numpy arrays, numbers and strings come back as default_collate builds them."""
    import numpy as np

    samples = [
        {"img": torch.rand(3, 4), "p": Point(i, float(i)), "arr": np.ones(2) * i, "s": f"s{i}", "l": [i, i + 1]}
        for i in range(3)
    ]
    _assert_same(_round_trip(samples), default_collate(samples))


def test_a_tensor_used_twice_stays_one_tensor():
    """A custom collate result that repeats a tensor yields two views of the same memory."""
    t = torch.arange(6.0)
    out = _round_trip(None, collate=lambda _: {"a": t, "b": t})
    assert out["a"].data_ptr() == out["b"].data_ptr() and torch.equal(out["a"], t)


def test_batch_without_tensors_needs_no_slot():
    """A batch of strings only occupies zero bytes and still round-trips."""
    payload, objs, leaves, nbytes = layout.plan(layout.slot_collate(["a", "b"]))
    assert nbytes == 0 and leaves == []
    assert layout.unpack(payload, leaves, None) == ["a", "b"]
