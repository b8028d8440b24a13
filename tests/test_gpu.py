"""On a CUDA machine: pinned ring slots, batches on the device, the device transform. Skipped without CUDA."""

import pytest
import torch

import _datasets as ds

pytestmark = [
    pytest.mark.fastfeed_only,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

import fastfeed  # noqa: E402


def test_pin_memory_batches_are_pinned_views_of_registered_slots():
    """pin_memory=True: every tensor is pinned, and is a view of a ring slot (no pinned copy)."""
    loader = fastfeed.DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2, pin_memory=True)
    it = iter(loader)
    slots = {s.segment.address for s in it._ring._slots}
    for batch in it:
        slots |= {s.segment.address for s in it._ring._slots}
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


def test_a_slow_consumer_never_sees_a_rewritten_slot():
    """With the consumer stream busy before each read, every batch still holds its own data."""
    loader = fastfeed.DataLoader(ds.PlainDataset(400), batch_size=4, num_workers=2, device="cuda",
                                 device_prefetch=3)  # fmt: skip
    for n, batch in enumerate(loader):
        torch.cuda._sleep(1_000_000)
        assert batch["x"][:, 0].tolist() == [float(i) for i in range(4 * n, 4 * n + 4)]


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
