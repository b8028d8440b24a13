"""On a CUDA machine: pinned ring slots, batches on the device, copies that run late, the device transform.

Skipped without CUDA. `bash scripts/gpu_check.sh` runs this file (through pytest, or scripts/gpu_tests.py where
pytest is not installed: keep to the pytest pieces that runner provides) before the checks of
fastfeed/bench/gpu/.
"""

import warnings

import pytest
import torch

import _datasets as ds

pytestmark = [
    pytest.mark.fastfeed_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

import fastfeed  # noqa: E402


def test_pin_memory_batches_are_pinned_and_views_of_registered_slots_once_registered():
    """pin_memory=True: every tensor is pinned; once the first epoch's slots are registered (in the background),
    every batch of the next epoch is a view of a ring slot (no pinned copy)."""
    from fastfeed._ring import pinner

    loader = fastfeed.DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2, pin_memory=True)
    for batch in loader:  # the first epoch: batches in slots still being registered are copied, as torch's are
        assert batch["x"].is_pinned() and batch["index"].is_pinned()
    del batch
    assert pinner.flush(30)
    it = iter(loader)
    for batch in it:
        slots = {s.segment.address for s in it._ring._slots}
        assert batch["x"].is_pinned() and batch["index"].is_pinned()
        assert batch["x"].untyped_storage().data_ptr() in slots


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_device_batches_equal_the_cpu_batches(worker_type):
    """device='cuda' yields the CPU loader's batches, on the GPU; non-tensor leaves unchanged."""
    gpu = list(fastfeed.DataLoader(ds.PlainDataset(24), batch_size=4, num_workers=2, worker_type=worker_type,
                                   device="cuda"))  # fmt: skip
    assert len(gpu) == 6
    for n, batch in enumerate(gpu):
        assert batch["x"].device.type == "cuda"
        want = ds.expected_plain_batch(list(range(4 * n, 4 * n + 4)))
        assert torch.equal(batch["x"].cpu(), want["x"]) and torch.equal(batch["index"].cpu(), want["index"])


def _cycles_per_ms():
    """How many clock cycles of torch.cuda._sleep make a millisecond on this GPU (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _expect_rows(x, first):
    """Rows of PlainDataset batches hold their index throughout: check the first and last column."""
    want = [float(i) for i in range(first, first + x.shape[0])]
    return x[:, 0].tolist() == want and x[:, -1].tolist() == want


def test_pin_memory_copies_queued_behind_kernels_read_their_own_batch():
    """pin_memory=True without device=: a .cuda(non_blocking=True) queued behind 50 ms of kernels, whose CPU batch
    dies at once while workers wait for slots, still copies that batch (its slot is not rewritten first)."""
    loader = fastfeed.DataLoader(ds.PlainDataset(120, width=16384), batch_size=4, num_workers=2, pin_memory=True,
                                 prefetch_factor=4)  # fmt: skip
    cycles = int(50 * _cycles_per_ms())
    kept = []
    for batch in loader:
        torch.cuda._sleep(cycles)  # the previous step's kernels, still running
        kept.append(batch["x"].cuda(non_blocking=True))
        del batch
    torch.cuda.synchronize()
    bad = [n for n, x in enumerate(kept) if not _expect_rows(x.cpu(), 4 * n)]
    assert len(kept) == 30 and not bad, f"batches {bad} were rewritten before their copy read them"


def test_the_device_stage_keeps_each_slot_until_its_delayed_copy_read_it():
    """device="cuda" with 20 ms queued on the copy stream before every copy, and a slow consumer: every batch
    holds its own rows, so no slot went back to the workers before its copy had read it."""
    from fastfeed import transfer

    cycles = int(_cycles_per_ms())
    real, made = transfer.copier_for, []

    def delayed(stage):
        copier = real(stage)
        start = copier.start

        def late_start(batch):
            with torch.cuda.stream(copier.stream):
                torch.cuda._sleep(20 * cycles)
            return start(batch)

        copier.start = late_start
        made.append(copier)
        return copier

    loader = fastfeed.DataLoader(ds.PlainDataset(120, width=16384), batch_size=4, num_workers=2, device="cuda",
                                 device_prefetch=2)  # fmt: skip
    transfer.copier_for = delayed
    try:
        it = iter(loader)
    finally:
        transfer.copier_for = real
    assert made, "the device stage did not take its copier from transfer.copier_for"
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastfeed.RingGrowthWarning)  # the host runs ahead of the late copies
        for batch in it:
            torch.cuda._sleep(10 * cycles)
            kept.append(batch["x"])
    torch.cuda.synchronize()
    bad = [n for n, x in enumerate(kept) if not _expect_rows(x.cpu(), 4 * n)]
    assert len(kept) == 30 and not bad, f"batches {bad} were rewritten before their copy read them"


def test_non_tensor_leaves_pass_through_unchanged():
    """Strings, ints and namedtuples of a nested batch arrive as the CPU loader gives them."""
    batch = next(iter(fastfeed.DataLoader(ds.NestedDataset(8), batch_size=4, num_workers=2, device="cuda")))
    assert batch["str"] == ["item-0", "item-1", "item-2", "item-3"] and type(batch["namedtuple"]) is ds.Point
    assert batch["tensor"].device.type == "cuda"


def test_image_normalize_on_the_device_matches_the_cpu():
    """ImageNormalize as device_transform gives, on the GPU, what it gives on the CPU."""
    from fastfeed.transforms import ImageNormalize

    images = torch.randint(0, 256, (32, 8, 8, 3), dtype=torch.uint8)
    norm = ImageNormalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), layout="NHWC", key=0)
    data = torch.utils.data.TensorDataset(images, torch.arange(32))
    loader = fastfeed.DataLoader(data, batch_size=8, num_workers=2, device="cuda", device_transform=norm)
    for n, (x, y) in enumerate(loader):
        ref = norm((images[8 * n : 8 * n + 8], None))[0]
        torch.testing.assert_close(x.cpu(), ref)
        assert y.device.type == "cuda"
