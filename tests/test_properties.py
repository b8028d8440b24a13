"""Property-based tests: random nested batches come back exactly as torch's default_collate builds them.

A batch is a list of samples that share one structure (nested dicts, lists, tuples and
namedtuples), with the same leaf types, dtypes and shapes in every sample; only the
values (and, for tensors, their memory layout) differ between samples. Leaves cover
tensors of many dtypes and shapes (zero-size, 0-d, and samples large enough for the
native gather path), numpy arrays and scalars, Python numbers, strings, bytes and None.
"""

from __future__ import annotations

import gc
import math
from collections import namedtuple

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, event, example, find, given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import _candidate
import _leaks
from _compare import assert_same, copy_batch
from fastfeed._ring import layout

Pair = namedtuple("Pair", ["a", "b"])
Triple = namedtuple("Triple", "x y z")

TORCH_DTYPES = [
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.complex64,
]  # fmt: skip
NP_DTYPES = [
    np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128, np.bool_,
]  # fmt: skip
GATHER_MIN = layout.GATHER_MIN_SAMPLE_BYTES
SEEDS = st.integers(0, 2**32 - 1)

FAST = settings(
    max_examples=250, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
# The loader level starts 2 workers per example (most of its time): the structures themselves are the layout level's
# (FAST, 250 examples, in this process), so the loader needs only a few draws to show that what the slot carries
# arrives through workers and a ring as torch's workers deliver it; the explicit examples add the gather path and
# an error whatever is drawn.
LOADER = settings(
    max_examples=7, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


# -- structures ("specs"): one per batch -------------------------------------------------


@st.composite
def _shapes(draw, itemsize):
    """A small shape (0-d to 3-d, zero-size dims allowed) or one over the gather threshold."""
    if draw(st.integers(0, 2)) < 2:
        return tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    numel = -(-GATHER_MIN // itemsize) + draw(st.integers(0, 2048))
    lead = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    return (*lead, -(-numel // math.prod(lead)))


@st.composite
def _tensor_specs(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    return ("tensor", dtype, draw(_shapes(dtype.itemsize)))


@st.composite
def _ndarray_specs(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    return ("ndarray", dtype, draw(_shapes(dtype.itemsize)))


_LEAF_SPECS = st.one_of(
    _tensor_specs(),
    _tensor_specs(),
    _ndarray_specs(),
    st.sampled_from(NP_DTYPES).map(lambda d: ("npscalar", np.dtype(d))),
    # None is rare: default_collate raises TypeError on it, so it fails the whole batch.
    st.sampled_from([("int",), ("float",), ("bool",), ("str",), ("bytes",)] * 2 + [("none",)]),
)


def _containers(children):
    return st.one_of(
        st.dictionaries(st.text(max_size=4), children, max_size=3).map(lambda d: ("dict", list(d.items()))),
        st.lists(children, max_size=3).map(lambda c: ("list", c)),
        st.lists(children, max_size=3).map(lambda c: ("tuple", c)),
        st.tuples(children, children).map(lambda c: ("namedtuple", Pair, list(c))),
        st.tuples(children, children, children).map(lambda c: ("namedtuple", Triple, list(c))),
    )


SPECS = st.recursive(_LEAF_SPECS, _containers, max_leaves=8)


# -- values: one sample of a spec --------------------------------------------------------


def _torch_values(dtype, shape, seed):
    """A contiguous tensor of `shape` with seeded values: full-range bits for integers,
    normals with an occasional inf, -inf or -0.0 for floating point (never NaN)."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        flat = torch.randint(0, 2, (numel,), generator=g).bool()
    elif not dtype.is_floating_point and not dtype.is_complex:
        flat = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    elif dtype.is_complex:
        flat = torch.randn(numel, dtype=dtype, generator=g) * 10.0 ** (seed % 5 - 2)
    else:
        flat = torch.randn(numel, dtype=torch.float64, generator=g) * 10.0 ** (seed % 7 - 3)
        if numel:
            flat[seed % numel] = (math.inf, -math.inf, -0.0, 0.0)[seed // numel % 4]
        flat = flat.to(dtype)
    return flat.reshape(shape)


def _tensor_layouts(dtype, shape):
    layouts = ["contiguous"] * 4 + ["offset"] * 2
    if len(shape) >= 1:
        layouts += ["strided", "expanded"]
    if len(shape) >= 2:
        layouts += ["transposed"]
    if dtype.is_complex:
        layouts += ["conj"]
    return layouts


def _tensor(dtype, shape, seed, how):
    """A tensor of `shape` and `dtype` laid out in memory as `how` says."""
    if how == "contiguous":
        return _torch_values(dtype, shape, seed)
    if how == "offset":  # contiguous, but not at the start of its storage
        pad = 1 + seed % 3
        return _torch_values(dtype, (math.prod(shape) + pad,), seed)[pad:].view(shape)
    if how == "strided":
        return _torch_values(dtype, (*shape[:-1], 2 * shape[-1]), seed)[..., ::2]
    if how == "expanded":
        return _torch_values(dtype, (*shape[:-1], 1), seed).expand(shape)
    if how == "transposed":
        return _torch_values(dtype, (*shape[:-2], shape[-1], shape[-2]), seed).transpose(-1, -2)
    if how == "conj":
        return _torch_values(dtype, shape, seed).conj()
    raise AssertionError(how)


def _np_values(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    scale = 10.0 ** (seed % 5 - 2)  # at most 100: float16 never overflows
    if dtype.kind == "c":
        return ((rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) * scale).astype(dtype)
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _ndarray(dtype, shape, seed, how):
    if how == "F":
        return np.asfortranarray(_np_values(dtype, shape, seed))
    if how == "strided":
        return _np_values(dtype, (*shape[:-1], 2 * shape[-1]), seed)[..., ::2]
    return _np_values(dtype, shape, seed)


_SCALARS = {
    "int": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(allow_nan=False),
    "bool": st.booleans(),
    "str": st.text(max_size=5),
    "bytes": st.binary(max_size=5),
    "none": st.none(),
}


@st.composite
def _sample(draw, spec, layouts=None):
    """One sample of `spec`; tensor memory layouts are drawn from `layouts` (default: all)."""
    kind = spec[0]
    if kind == "tensor":
        _, dtype, shape = spec
        options = [h for h in _tensor_layouts(dtype, shape) if layouts is None or h in layouts]
        return _tensor(dtype, shape, draw(SEEDS), draw(st.sampled_from(options)))
    if kind == "ndarray":
        _, dtype, shape = spec
        options = ["C"] * 4 + (["F", "strided"] if shape else [])
        return _ndarray(dtype, shape, draw(SEEDS), draw(st.sampled_from(options)))
    if kind == "npscalar":
        return _np_values(spec[1], (), draw(SEEDS))[()]
    if kind in _SCALARS:
        return draw(_SCALARS[kind])
    if kind == "dict":
        return {key: draw(_sample(child, layouts)) for key, child in spec[1]}
    if kind == "list":
        return [draw(_sample(child, layouts)) for child in spec[1]]
    if kind == "tuple":
        return tuple(draw(_sample(child, layouts)) for child in spec[1])
    if kind == "namedtuple":
        return spec[1](*(draw(_sample(child, layouts)) for child in spec[2]))
    raise AssertionError(kind)


@st.composite
def batches(draw, min_size=1, max_size=5, layouts=None):
    """A list of samples with one shared structure, dtypes and shapes."""
    spec = draw(SPECS)
    n = draw(st.integers(min_size, max_size))
    return [draw(_sample(spec, layouts)) for _ in range(n)]


# -- helpers ---------------------------------------------------------------------------


def _round_trip(samples):
    """slot_collate -> plan -> fill into a fresh uint8 base -> unpack, all in this process."""
    payload, objs, leaves, nbytes = layout.plan(layout.slot_collate(samples))
    base = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    layout.fill(base, objs, leaves)
    return layout.unpack(payload, leaves, base if nbytes else None)


def _takes_gather(samples):
    """Whether filling this batch uses the native gather for at least one leaf."""
    try:
        _, objs, _, _ = layout.plan(layout.slot_collate(samples))
    except Exception:  # noqa: BLE001 - a batch default_collate rejects gathers nothing
        return False
    return any(
        type(o) is layout.Stack and o.tensors[0].nbytes >= GATHER_MIN and layout._gatherable(o) for o in objs
    )


def _outcome(fn, *args):
    """("ok", result) or ("raise", exception type, message)."""
    try:
        return ("ok", fn(*args))
    except Exception as error:  # noqa: BLE001 - compared with the reference's outcome
        return ("raise", type(error), str(error))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _bits(t):
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def assert_identical(got, ref, path="batch"):
    """assert_same, and every tensor equal bit for bit (so -0.0 is not 0.0)."""
    assert_same(got, ref, path)
    for g, r in zip(_tensors(got), _tensors(ref)):
        assert torch.equal(_bits(g), _bits(r)), f"{path}: tensor bits differ"


def assert_same_outcome(got, ref):
    assert got[0] == ref[0], f"fastfeed {got[0]}s where torch {ref[0]}s: {got[1:]} vs {ref[1:]}"
    if ref[0] == "ok":
        assert_identical(got[1], ref[1])
    else:
        assert got[1:] == ref[1:]


class SamplesDataset(tud.Dataset):
    """Map-style: item i is samples[i], the very same object every time."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def identity_collate(batch):
    """A custom collate_fn: the list of samples, unchanged."""
    return batch


def _epoch(loader_cls, dataset, copy, **kwargs):
    """One epoch as a list of ("ok", batch), ending with ("raise", type, message) if one raised."""
    loader = loader_cls(dataset, **kwargs)
    it = iter(loader)
    out = []
    try:
        for batch in it:
            out.append(("ok", copy_batch(batch) if copy else batch))
            del batch
    except Exception as error:  # noqa: BLE001 - compared with the reference's outcome
        out.append(("raise", type(error), str(error)))
        _leaks.drop_tracebacks(error)
    finally:
        del it, loader
        gc.collect()
    return out


def _compare_loaders(samples, batch_size, collate_fn):
    dataset = SamplesDataset(samples)
    kwargs = {"batch_size": batch_size}
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    ref = _epoch(tud.DataLoader, dataset, copy=False, **kwargs)
    # Batches are copied as they arrive, as a training loop would use them, so slots recycle.
    workers = {"num_workers": 2, "multiprocessing_context": "fork"}
    got = _epoch(_candidate.DataLoader, dataset, copy=True, **workers, **kwargs)
    assert [o[0] for o in got] == [o[0] for o in ref]
    for i, (g, r) in enumerate(zip(got, ref)):
        if r[0] == "ok":
            assert_identical(g[1], r[1], f"batch {i}")
        else:
            # A worker's error is re-raised wrapped, with torch's own message inside.
            assert g[1] is r[1] and r[2] in g[2], f"{g[1:]} vs {r[1:]}"


@st.composite
def _datasets(draw, layouts=None):
    batch_size = draw(st.integers(1, 3))
    samples = draw(batches(min_size=1, max_size=7, layouts=layouts))
    return samples, batch_size


# -- layout level ------------------------------------------------------------------------


@pytest.mark.fastfeed_only
@FAST
@given(batch=batches())
@example(batch=[{"a": None, "t": torch.ones(2)}, {"a": None, "t": torch.zeros(2)}])
@example(batch=[{"n": 2**64}, {"n": 1}])
@example(batch=[np.array(["ab"]), np.array(["cd"])])
@example(batch=[torch.zeros(0, 3), torch.zeros(0, 3)])
@example(batch=[(torch.full((GATHER_MIN,), -0.0, dtype=torch.float16), 1.5)] * 3)
def test_slot_round_trip_matches_default_collate(batch):
    """plan/fill/unpack of slot_collate gives default_collate's batch exactly, or raises the same error."""
    event("gather path" if _takes_gather(batch) else "torch.stack path only")
    assert_same_outcome(_outcome(_round_trip, batch), _outcome(default_collate, batch))


@pytest.mark.fastfeed_only
def test_the_batch_strategy_reaches_the_gather_path():
    """The strategy above produces batches whose large leaves take the native gather."""
    found = find(batches(), _takes_gather, settings=settings(derandomize=True, database=None))
    assert _takes_gather(found)


# -- loader level ------------------------------------------------------------------------

# Large leaves (the gather path, and big slot copies) and an error, whatever the strategy draws.
_LARGE = (
    [
        {"img": _tensor(torch.float32, (64, 80), i, "contiguous"), "y": i, "m": Pair(np.int64(i), f"s{i}")}
        for i in range(5)
    ],
    2,
)
_NONE = ([{"t": torch.ones(3), "x": None} for _ in range(3)], 2)


@pytest.mark.hang_limit(120)
@LOADER
@given(data=_datasets())
@example(data=_LARGE)
@example(data=_NONE)
def test_loader_default_collate_matches_torch(data):
    """fastfeed.DataLoader with 2 workers yields torch's batch sequence, or raises torch's error."""
    samples, batch_size = data
    _compare_loaders(samples, batch_size, None)


# Layouts the slot reproduces: permuted dense tensors keep their strides; sliced and
# expanded ones arrive contiguous (their storage is not shipped).
_KEPT_BY_COPY = ("contiguous", "offset", "conj", "transposed")


@pytest.mark.hang_limit(120)
@LOADER
@given(data=_datasets(layouts=_KEPT_BY_COPY))
@example(data=_LARGE)
def test_loader_identity_collate_matches_torch(data):
    """With a collate_fn returning the samples unchanged, fastfeed's batches equal torch's."""
    samples, batch_size = data
    _compare_loaders(samples, batch_size, identity_collate)


def test_identity_collate_keeps_tensor_strides():
    """A non-contiguous tensor from a custom collate_fn keeps torch's strides (a transpose, channels_last)."""
    samples = [{"t": torch.arange(6.0).view(2, 3).t()}, {"t": torch.arange(6.0, 12.0).view(2, 3).t()}]
    _compare_loaders(samples, 2, identity_collate)
    images = [{"img": torch.rand(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)} for _ in range(2)]
    _compare_loaders(images, 2, identity_collate)
