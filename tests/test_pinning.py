"""Ring segments registered with CUDA once (cudaHostRegister), checked on a CPU with a fake runtime.

tests/fake_cudart.c stands in for libcudart: it records registered ranges and counts an
unregister of unmapped memory as a fault. Each case runs in a script of its own, because a
loaded runtime stays loaded for the life of a process.
"""

import os
import shutil
import subprocess
import textwrap

import pytest

from _scripts import finish, start_script

pytestmark = pytest.mark.fastfeed_only

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake CUDA runtime")
    path = tmp_path_factory.mktemp("cudart") / "libcudart_fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(path), os.path.join(TESTS_DIR, "fake_cudart.c")],
                   check=True)  # fmt: skip
    return str(path)


PRELUDE = """
import ctypes, gc
import torch
from fastfeed import _pinning
from fastfeed._iterator import RingDataLoaderIter
fake = ctypes.CDLL(os.environ["FASTFEED_CUDART"])
fake.fake_is_registered.argtypes = [ctypes.c_void_p]
assert _pinning.enable() == "", _pinning.enable()
RingDataLoaderIter._pin_slots = lambda self, wanted: True  # what a CUDA machine decides

def registered(t):
    return fake.fake_is_registered(t.untyped_storage().data_ptr()) == 1
"""


def run(fake_cudart, body):
    proc = start_script(PRELUDE + textwrap.dedent(body), FASTFEED_CUDART=fake_cudart)
    out, err = finish(proc, timeout=60)
    assert proc.returncode == 0, out + err
    return out


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_every_batch_lies_in_registered_memory_and_all_is_unregistered_before_unmap(fake_cudart, worker_type):
    """Batches (adopted first slots, grown slots, one-off segments) are in registered memory; at the end every
    range is unregistered, each while still mapped, and each exactly once."""
    out = run(
        fake_cudart,
        f"""
        loader = _candidate.DataLoader(ds.GrowingDataset(48, 4), batch_size=4, num_workers=2, collate_fn=ds.pad_collate,
                                       worker_type={worker_type!r})
        n = 0
        for batch in loader:
            assert all(registered(t) for t in batch if isinstance(t, torch.Tensor)), n
            n += 1
        del loader, batch
        gc.collect()
        print("BATCHES", n, "CALLS", fake.fake_register_calls(), fake.fake_unregister_calls(),
              "LEFT", fake.fake_registered(), "FAULTS", fake.fake_faults())
    """,
    )
    words = out.split()
    calls, uncalls = int(words[3]), int(words[4])
    assert words[1] == "12" and calls >= 4 and calls == uncalls, out
    assert words[6] == "0" and words[8] == "0", out


def test_slots_are_registered_once_however_many_batches_pass(fake_cudart):
    """Registration happens per segment, not per batch: 100 fixed-size batches through 4 slots register about 4."""
    out = run(
        fake_cudart,
        """
        loader = _candidate.DataLoader(ds.PlainDataset(400), batch_size=4, num_workers=2)
        for batch in loader:
            assert registered(batch["x"])
        print("CALLS", fake.fake_register_calls())
    """,
    )
    assert 3 <= int(out.split()[1]) <= 6, out


def test_a_failed_registration_is_a_runtime_error_naming_cuda_s_reason(fake_cudart):
    """When cudaHostRegister fails, the error names the call, the bytes and CUDA's text."""
    out = run(
        fake_cudart,
        """
        from fastfeed._ring import segments
        from fastfeed._ring.ring import Ring
        ring = Ring(2, pin=True)
        made = segments.create(ring.prefix, 4096)  # as a worker makes one when no slot is free
        fake.fake_fail_next(2)
        try:
            ring.receive(None, made.name)
        except RuntimeError as e:
            print("ERROR", e)
        ring.close()
    """,
    )
    assert "cudaHostRegister of 4096 bytes failed with error 2: out of memory" in out, out
