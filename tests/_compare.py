"""Comparing batches: bit-identical, type-faithful, optionally order-insensitive."""

import random
from collections.abc import Mapping

import numpy as np
import torch


def seed_all(seed):
    """Seed the three RNGs a sample draws from (torch, random, numpy)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def copy_batch(obj):
    """Deep copy of a batch that keeps every container type and owns its tensor memory."""
    if isinstance(obj, torch.Tensor):
        return obj.clone(memory_format=torch.preserve_format)
    if isinstance(obj, dict):
        return type(obj)((k, copy_batch(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(copy_batch(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_batch(v) for v in obj)
    return obj


def assert_same(got, ref, path="batch"):
    """Bit-identical: same types all the way down, torch.equal tensors, == other leaves."""
    assert type(got) is type(ref), f"{path}: type {type(got).__name__} != {type(ref).__name__}"
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype, f"{path}: dtype {got.dtype} != {ref.dtype}"
        assert got.shape == ref.shape, f"{path}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        # Same layout too: code that calls .view() on a batch must keep working.
        assert got.stride() == ref.stride(), f"{path}: stride {got.stride()} != {ref.stride()}"
        assert got.device == ref.device and got.requires_grad == ref.requires_grad, path
        assert torch.equal(got, ref), f"{path}: values differ\n{got}\n!=\n{ref}"
    elif isinstance(ref, np.ndarray):
        assert got.dtype == ref.dtype and got.shape == ref.shape, f"{path}: dtype/shape differ"
        assert np.array_equal(got, ref), f"{path}: values differ"
    elif isinstance(ref, Mapping):
        assert list(got) == list(ref), f"{path}: keys {list(got)} != {list(ref)}"
        for key in ref:
            assert_same(got[key], ref[key], f"{path}[{key!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(got) == len(ref), f"{path}: length {len(got)} != {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_same(g, r, f"{path}[{i}]")
    else:
        assert got == ref, f"{path}: {got!r} != {ref!r}"


def frozen(obj):
    """A hashable, type-faithful rendering of a batch, for order-insensitive comparison."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.contiguous().numpy().tobytes())
    if isinstance(obj, Mapping):
        return (type(obj).__name__, tuple((k, frozen(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(frozen(v) for v in obj))
    return (type(obj).__name__, obj)
