"""The device stage, on a CPU: copies ahead, slot release after the copy's event, state, arguments.

``FakeCopier`` stands in for CUDA streams and events: a copy is only *issued* by start()
and reads its source when its event completes (as a DMA engine would), so a slot released
too early shows up as a wrong batch.
"""

import collections
import ctypes
import gc
import time
import weakref

import pytest
import torch

import _datasets as ds
from _compare import assert_same, copy_batch, seed_all

pytestmark = pytest.mark.fastfeed_only

import fastfeed  # noqa: E402
from fastfeed import transfer  # noqa: E402


class FakeEvent:
    def __init__(self, copier, ops):
        self.copier, self.ops, self.complete = copier, ops, False


def _raw(t):
    """What a DMA engine holds of a contiguous source: its address, not a reference that keeps it alive."""
    if not t.is_contiguous() or t.numel() == 0:
        return lambda: t
    address, nbytes, dtype, shape = t.data_ptr(), t.nbytes, t.dtype, t.shape
    return lambda: torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8).view(
        dtype).view(shape)  # fmt: skip


class FakeCopier:
    """Copies that run when their event completes: at hand-over (the consumer waits), wait(), or complete()."""

    def __init__(self, transform=None):
        self.transform = transform
        self.events: collections.deque = collections.deque()  # recorded, not yet complete
        self.handed = []

    def start(self, batch):
        ops = []

        def deferred(t):
            dst = torch.empty_like(t)
            ops.append((dst, _raw(t)))
            return dst

        out = transfer.map_tensors(batch, deferred)
        event = FakeEvent(self, ops)
        if self.transform is not None:
            ops.append(("transform", out))
        self.events.append(event)
        return out, event

    def complete(self, event):
        """Complete every event up to ``event``, in order (one stream)."""
        while not event.complete:
            first = self.events.popleft()
            for dst, src in first.ops:
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src())
            first.ops, first.complete = None, True

    def done(self, event):
        return event.complete

    def wait(self, event):
        self.complete(event)

    def hand_over(self, out, event):
        self.complete(event)
        self.handed.append(out)

    def elapsed(self, event):
        return None


def tagged(n):
    """A source of n CPU batches that keeps none of them, and the list of those that died."""
    dead = []

    def source():
        for i in range(n):
            b = torch.full((4,), float(i))
            weakref.finalize(b, dead.append, i)
            yield b
            del b

    return source(), dead


def test_copies_run_ahead_only_when_the_next_batch_is_ready():
    """With ahead=2 and batches ready, two more copies are in flight; with nothing ready, none."""
    batches, _ = tagged(6)
    stage = transfer.DeviceIter(batches, FakeCopier(), 2, lambda: True)
    assert next(stage).tolist() == [0.0] * 4
    assert stage.held_back == 2
    waiting = transfer.DeviceIter(iter([torch.zeros(1), torch.ones(1)]), FakeCopier(), 2, lambda: False)
    next(waiting)
    assert waiting.held_back == 0


def test_a_cpu_batch_lives_until_its_copy_completed_then_goes():
    """The CPU batch (its slot) is kept until its copy's event completes, and released on the next call after."""
    batches, dead = tagged(4)
    copier = FakeCopier()
    never_done = copier.done
    copier.done = lambda event: False  # the consumer's copies are still running
    stage = transfer.DeviceIter(batches, copier, 1, lambda: True)
    gc.collect()
    next(stage)
    next(stage)
    gc.collect()
    assert dead == [], "a slot was released while its copy could still be reading it"
    copier.done = never_done
    next(stage)
    gc.collect()
    assert dead == [0, 1], dead


def test_batches_are_handed_over_in_order_and_the_end_waits_for_every_copy():
    """Every batch arrives once, in order; at the end the stage waits for all copies, then calls on_end once."""
    batches, dead = tagged(5)
    ended = []
    copier = FakeCopier()
    stage = transfer.DeviceIter(batches, copier, 3, lambda: True, on_end=lambda: ended.append(1))
    got = [b[0].item() for b in stage]
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(StopIteration):
        next(stage)
    gc.collect()
    assert sorted(dead) == [0, 1, 2, 3, 4] and ended == [1] and not copier.events


def test_map_tensors_keeps_containers_and_non_tensor_leaves():
    """Nested dicts, lists, tuples and namedtuples keep their types; strings, ints and None pass through."""
    batch = {"a": [torch.ones(2), "s", 3], "b": ds.Point(torch.zeros(1), None), "c": (torch.ones(1),)}
    out = transfer.map_tensors(batch, lambda t: t + 1)
    assert type(out["b"]) is ds.Point and out["a"][1:] == ["s", 3] and out["b"].y is None
    assert out["a"][0].tolist() == [2.0, 2.0] and type(out["c"]) is tuple


# --- through the loader ------------------------------------------------------------------------


class SlowFakeCopier(FakeCopier):
    """A FakeCopier whose copies complete 10 ms after hand-over: time for workers to rewrite a freed slot."""

    def hand_over(self, out, event):
        time.sleep(0.01)
        super().hand_over(out, event)


@pytest.fixture
def fake_device(monkeypatch):
    """device='cpu' loaders get a SlowFakeCopier: copies complete only when the batch is handed over."""
    made = []

    def copier_for(stage):
        made.append(SlowFakeCopier(stage.transform))
        return made[-1]

    monkeypatch.setattr(transfer, "copier_for", copier_for)
    return made


@pytest.mark.parametrize("worker_type", ["process", "thread"])
@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_no_slot_is_rewritten_while_its_copy_is_pending(fake_device, worker_type, ahead):
    """Through the ring with deferred copies, every batch arrives intact: slots wait for their copies."""
    loader = fastfeed.DataLoader(ds.PlainDataset(96), batch_size=4, num_workers=2, prefetch_factor=1,
                                 worker_type=worker_type, device="cpu", device_prefetch=ahead)  # fmt: skip
    for n, batch in enumerate(loader):
        assert_same(batch, ds.expected_plain_batch(list(range(4 * n, 4 * n + 4))))
    assert n == 23 and fake_device


def test_device_cpu_matches_the_plain_loader_and_applies_the_transform():
    """device='cpu' yields the plain loader's batches; device_transform sees each batch once."""
    seen = []

    def transform(batch):
        seen.append(1)
        return {**batch, "x": batch["x"] * 2}

    plain = [copy_batch(b) for b in fastfeed.DataLoader(ds.PlainDataset(20), batch_size=4, num_workers=2)]
    staged = [copy_batch(b) for b in fastfeed.DataLoader(ds.PlainDataset(20), batch_size=4, num_workers=2,
                                                          device="cpu", device_transform=transform)]  # fmt: skip
    assert len(seen) == 5
    for p, s in zip(plain, staged):
        assert_same(s["index"], p["index"])
        assert torch.equal(s["x"], p["x"] * 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_counts_only_batches_handed_over(num_workers):
    """With batches copied ahead, state_dict() resumes after the last batch the user got, not the last one fetched."""

    def make():
        return fastfeed.DataLoader(ds.AugmentedDataset(40), batch_size=4, num_workers=num_workers, shuffle=True,
                                   device="cpu", device_prefetch=3)  # fmt: skip

    seed_all(11)
    full = [copy_batch(b) for b in make()]
    seed_all(11)
    loader = make()
    it = iter(loader)
    head = [copy_batch(next(it)) for _ in range(4)]
    state = loader.state_dict()
    assert state["yielded"] == 4
    del it
    seed_all(999)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(head + [copy_batch(b) for b in resumed], full)


def test_state_dict_while_the_stage_holds_the_last_batches_of_an_epoch():
    """state_dict() while the stage holds an epoch's last batches, already fetched, still resumes exactly."""

    def make():
        return fastfeed.DataLoader(ds.AugmentedDataset(24), batch_size=4, num_workers=2, device="cpu",
                                   device_prefetch=4)  # fmt: skip

    seed_all(3)
    full = [copy_batch(b) for b in make()]
    seed_all(3)
    loader = make()
    it = iter(loader)
    head = [copy_batch(next(it)) for _ in range(3)]
    time.sleep(0.5)  # the workers finish the epoch meanwhile
    head.append(copy_batch(next(it)))
    assert it.held_back == 2  # batches 5 and 6 are taken and copied, not handed over
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(head + [copy_batch(b) for b in resumed], full)


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_device_without_cuda_fails_at_construction():
    """device='cuda' on a machine without CUDA is a RuntimeError at construction that says what to do."""
    with pytest.raises(RuntimeError, match=r"device='cuda'\) needs CUDA.*Use device='cpu'"):
        fastfeed.DataLoader(ds.PlainDataset(4), device="cuda")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"device_transform": lambda b: b}, ValueError, "pass device= too"),
    ({"device": "cpu", "device_prefetch": -1}, ValueError, "device_prefetch must be an int >= 0"),
    ({"device": "cpu", "device_transform": 3}, TypeError, "device_transform must be callable"),
    ({"device": "meta"}, ValueError, "supports 'cuda' and 'cpu'"),
    ({"device": "nonsense"}, ValueError, "is not a device"),
])  # fmt: skip
def test_bad_device_arguments_are_clear_errors(kwargs, error, match):
    """Device arguments of the wrong kind raise errors that name the argument."""
    with pytest.raises(error, match=match):
        fastfeed.DataLoader(ds.PlainDataset(4), **kwargs)


def test_image_normalize_matches_a_float_reference():
    """ImageNormalize turns NHWC or NCHW uint8 into normalized NCHW floats (channels_last when asked)."""
    from fastfeed.transforms import ImageNormalize

    x = torch.randint(0, 256, (2, 5, 6, 3), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    ref = (x.permute(0, 3, 1, 2).float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    out = ImageNormalize(mean, std, layout="NHWC", channels_last=True)(x)
    assert out.shape == (2, 3, 5, 6) and out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref)
    pair = ImageNormalize(mean, std, dtype=torch.bfloat16, key=0)((x.permute(0, 3, 1, 2), "labels"))
    assert pair[1] == "labels" and pair[0].dtype == torch.bfloat16
    torch.testing.assert_close(pair[0].float(), ref, atol=0.02, rtol=0.01)
    with pytest.raises(TypeError, match="expects a 4-d uint8 batch"):
        ImageNormalize(mean, std)(x.float())


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_persistent_workers_with_a_device_stage_across_an_abandoned_epoch(fake_device, worker_type):
    """Persistent workers behind a device stage: an epoch left after 3 batches, then two whole epochs, all intact."""
    loader = fastfeed.DataLoader(ds.PlainDataset(48), batch_size=4, num_workers=2, persistent_workers=True,
                                 worker_type=worker_type, device="cpu", device_prefetch=2)  # fmt: skip
    for epoch, limit in enumerate((3, None, None)):
        got = [copy_batch(b) for _, b in zip(range(limit or 99), loader)]
        assert len(got) == (limit or 12), epoch
        for n, batch in enumerate(got):
            assert_same(batch, ds.expected_plain_batch(list(range(4 * n, 4 * n + 4))))
