"""Ring segments registered with CUDA once (cudaHostRegister), checked on a CPU with a fake runtime.

tests/fake_cudart.c stands in for libcudart: it records registered ranges (and the device and
thread each registration ran under), counts an unregister of unmapped memory as a fault, can fail
the next call, and can hold registrations until the test lets them go. Each case runs in a script of
its own, because a loaded runtime stays loaded for the life of a process.
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
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(path), os.path.join(TESTS_DIR, "fake_cudart.c"),
                    "-lpthread"], check=True)  # fmt: skip
    return str(path)


LOAD = """
import ctypes, gc, threading, warnings
import torch
from fastfeed import _pinning
from fastfeed._iterator import RingDataLoaderIter
from fastfeed._ring import fence, pinner
fake = ctypes.CDLL(os.environ["FASTFEED_CUDART"])
fake.fake_is_registered.argtypes = [ctypes.c_void_p]
for name in ("fake_registered", "fake_register_calls", "fake_unregister_calls", "fake_faults",
             "fake_registered_on", "fake_last_register_tid"):
    getattr(fake, name).restype = ctypes.c_long

def registered(t):
    return fake.fake_is_registered(t.untyped_storage().data_ptr()) == 1
"""

PRELUDE = LOAD + """
assert _pinning.enable() == "", _pinning.enable()
RingDataLoaderIter._pin_slots = lambda self, wanted, device: True  # what a CUDA machine decides
"""


def run(fake_cudart, body, prelude=PRELUDE, timeout=60):
    proc = start_script(prelude + textwrap.dedent(body), FASTFEED_CUDART=fake_cudart)
    out, err = finish(proc, timeout=timeout)
    assert proc.returncode == 0, out + err
    return out


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_once_registered_every_batch_of_a_later_epoch_lies_in_registered_memory(fake_cudart, worker_type):
    """After the first epoch's slots are registered (in the background), a second epoch's batches are all pinned.

    All but those in slots the second epoch added: a worker that finds no slot free (the machine busy, the loop
    late to free one) adds a slot, registered in the background like the first epoch's; seen once in a full run.
    """
    out = run(
        fake_cudart,
        f"""
        loader = _candidate.DataLoader(ds.PlainDataset(96), batch_size=4, num_workers=2, worker_type={worker_type!r})
        assert len(list(b["x"].clone() for b in loader)) == 24
        assert pinner.flush(10)
        old = [(s.segment.address, s.segment.address + s.segment.size) for s in loader._ff_ring._slots]

        def in_old_slot(t):
            p = t.untyped_storage().data_ptr()
            return any(a <= p < b for a, b in old)

        seen = [(registered(b["x"]) and registered(b["index"]), in_old_slot(b["x"])) for b in loader]
        print("PINNED", sum(r for r, _ in seen), len(seen), "UNPINNED_IN_OLD", sum(o and not r for r, o in seen),
              "IN_OLD", sum(o for _, o in seen))
    """,
    )
    words = out.split()
    pinned, batches, unpinned_in_old, in_old = int(words[1]), int(words[2]), int(words[4]), int(words[6])
    assert batches == 24 and unpinned_in_old == 0 and in_old >= 12, out
    assert pinned >= in_old, out


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_grown_and_replaced_slots_are_unregistered_once_each_while_still_mapped(fake_cudart, worker_type):
    """Slots adopted, grown and replaced are registered, and at the end every range is unregistered once, while
    still mapped; one-off segments are never registered."""
    out = run(
        fake_cudart,
        f"""
        before = fake.fake_register_calls()  # the probe's
        loader = _candidate.DataLoader(ds.GrowingDataset(48, 4), batch_size=4, num_workers=2,
                                       collate_fn=ds.pad_collate, worker_type={worker_type!r})
        n = sum(1 for _ in loader)
        del loader
        gc.collect()
        assert pinner.flush(10)
        print("BATCHES", n, "CALLS", fake.fake_register_calls() - before, fake.fake_unregister_calls() - before,
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
        before = fake.fake_register_calls()
        loader = _candidate.DataLoader(ds.PlainDataset(400), batch_size=4, num_workers=2)
        assert sum(1 for _ in loader) == 100
        assert pinner.flush(10)
        print("CALLS", fake.fake_register_calls() - before, "SLOTS", len(loader._ff_ring._slots))
    """,
    )
    words = out.split()  # a loaded machine may need a slot or two more; never one registration per batch
    assert words[1] == words[3] and int(words[1]) <= 20, out


def test_registration_runs_under_the_target_device_in_a_thread_of_its_own(fake_cudart):
    """A loader headed for cuda:1 registers every segment with device 1 current, never on device 0 (where a context
    would cost GPU 0 memory), and never on the loop's thread."""
    out = run(
        fake_cudart,
        """
        import fastfeed._iterator as iterator
        iterator._cuda_index = lambda stage, pin_memory_device: 1
        on0, on1 = fake.fake_registered_on(0), fake.fake_registered_on(1)
        loader = _candidate.DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2)
        assert sum(1 for _ in loader) == 16
        assert pinner.flush(10)
        print("ON0", fake.fake_registered_on(0) - on0, "ON1", fake.fake_registered_on(1) - on1,
              "LOOP", fake.fake_last_register_tid() == threading.get_native_id())
    """,
    )
    words = out.split()
    assert words[1] == "0" and int(words[3]) >= 3 and words[5] == "False", out


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_the_loop_never_waits_for_a_registration(fake_cudart, worker_type):
    """With every cudaHostRegister held back, a whole first epoch still arrives, intact; the slots are registered
    once the runtime lets go."""
    out = run(
        fake_cudart,
        f"""
        fake.fake_hold(1)
        loader = _candidate.DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2, worker_type={worker_type!r})
        for n, batch in enumerate(loader):
            assert torch.equal(batch["x"], ds.expected_plain_batch(list(range(4 * n, 4 * n + 4)))["x"]), n
            assert not registered(batch["x"])
        del batch  # a batch kept into the next epoch would take a slot, and a new one would be made
        fake.fake_hold(0)
        assert pinner.flush(10)
        print("EPOCH", n + 1, "PINNED", all(registered(b["x"]) for b in loader))
    """,
        timeout=45,
    )
    assert out.split() == ["EPOCH", "16", "PINNED", "True"], out


def test_a_failed_registration_mid_epoch_warns_once_and_the_epoch_goes_on(fake_cudart):
    """When cudaHostRegister fails for a segment, the epoch continues with every batch intact, and one warning
    names the call, the bytes and CUDA's text."""
    out = run(
        fake_cudart,
        """
        loader = _candidate.DataLoader(ds.PlainDataset(64), batch_size=4, num_workers=2)
        fake.fake_fail_next(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n, batch in enumerate(loader):
                assert torch.equal(batch["x"], ds.expected_plain_batch(list(range(4 * n, 4 * n + 4)))["x"]), n
                if n == 0:
                    assert pinner.flush(10)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        print("BATCHES", n + 1, "WARNINGS", len(messages))
        print(messages[0])
    """,
    )
    assert out.split()[:4] == ["BATCHES", "16", "WARNINGS", "1"], out
    assert "cudaHostRegister of" in out and "failed with error 2: out of memory" in out, out


def test_a_machine_where_registering_shared_memory_fails_copies_from_the_start(fake_cudart):
    """enable() tries registering two pages of shared memory once: where that fails it says why, and an iterator
    then warns and pins by copying, as torch does, instead of failing mid-epoch."""
    out = run(
        fake_cudart,
        """
        fake.fake_fail_next(2)
        why = _pinning.enable()
        print("WHY", why)
        holder = type("It", (), {"_pin_memory": True, "_staged": False})()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print("PIN", RingDataLoaderIter._pin_slots(holder, True, -1))
        print("WARNED", [str(w.message) for w in caught])
        print("LEFT", fake.fake_registered())
    """,
        prelude=LOAD,
    )
    assert "WHY registering shared memory with CUDA fails here (cudaHostRegister of 8192 bytes" in out, out
    assert "PIN False" in out and "batches are pinned by copying instead" in out and "LEFT 0" in out, out


def test_a_registration_failure_reports_cuda_s_reason_on_the_segment(fake_cudart):
    """Segment.pin raises a RuntimeError that names the call, the bytes and CUDA's text; a bad device is named."""
    out = run(
        fake_cudart,
        """
        from fastfeed._ring import segments
        ring_prefix = segments.new_prefix()
        made = segments.create(ring_prefix, 4096)
        segments.unlink(made.name)
        fake.fake_fail_next(2)
        for device in (-1, 99):
            try:
                made.pin(device)
            except RuntimeError as e:
                print("ERROR", e)
    """,
    )
    assert "cudaHostRegister of 4096 bytes failed with error 2: out of memory" in out, out
    assert "cudaSetDevice(99) failed with error 101: invalid device ordinal" in out, out


FAKE_DMA = """
import collections

class FakeDma:
    '''x = t.cuda(non_blocking=True) whose DMA reads t only when it runs, and events (a fence) that complete with it.'''

    def __init__(self):
        self.queued, self.count, self.completed = collections.deque(), 0, 0

    def copy(self, t):
        out = torch.empty_like(t)
        self.queued.append((out, t.data_ptr(), t.nbytes))  # the engine holds an address, not a reference
        self.count += 1
        return out

    def run(self, keep):
        '''The oldest copies run now, reading their sources as they are now, leaving `keep` queued.'''
        while len(self.queued) > keep:
            out, address, nbytes = self.queued.popleft()
            src = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
            out.view(-1).view(torch.uint8).copy_(src)
            self.completed += 1

    def record(self):
        return self.count  # done once every copy queued so far has run

    def done(self, token):
        return self.completed >= token

    def wait(self, token):
        self.run(self.count - token)

def corrupted(worker_type, fenced, lag=6):
    '''Batches whose delayed copy read something else, with the user's loop dropping each CPU batch at once.'''
    dma = FakeDma()
    fence.fence_for = (lambda device: dma) if fenced else (lambda device: None)
    loader = _candidate.DataLoader(ds.PlainDataset(400), batch_size=4, num_workers=2, worker_type=worker_type)
    copies = []
    for batch in loader:
        copies.append((dma.copy(batch["x"]), batch["index"].clone()))
        del batch  # the last view of the slot dies while its copy is still queued
        dma.run(keep=lag)
    dma.run(keep=0)
    bad = sum(not torch.equal(x, ds.expected_plain_batch(i.tolist())["x"]) for x, i in copies)
    return bad, len(loader._ff_ring._slots)
"""


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_pinned_slot_is_not_rewritten_while_a_copy_from_it_is_queued(fake_cudart, worker_type):
    """pin_memory without device=: a slot whose last view died goes back only once the copy queued from it has run,
    so 100 copies each delayed by 6 batches all read their own batch; without the fence, the same loop reads
    slots that workers already rewrote."""
    out = run(
        fake_cudart,
        f"""
        print("FENCED", *corrupted({worker_type!r}, fenced=True))
        print("UNFENCED", *corrupted({worker_type!r}, fenced=False))
    """,
        prelude=PRELUDE + FAKE_DMA,
    )
    words = out.split()
    assert words[:2] == ["FENCED", "0"] and int(words[2]) <= 16, out  # the ring holds the delayed slots, no more
    assert words[3] == "UNFENCED" and int(words[4]) > 0, f"the race could not be lost, so the test proves nothing: {out}"


def test_the_cuda_runtime_is_found_under_auditwheel_s_renamed_file_too(fake_cudart, tmp_path):
    """A libcudart that auditwheel renamed (libcudart-<hash>.so.N) and a plain libcudart.so.N are both found in the
    process's mappings; torch's own copy wins over another."""
    renamed = tmp_path / "libcudart-1a2b3c4d.so.12"
    shutil.copy(fake_cudart, renamed)
    out = run(
        fake_cudart,
        f"""
        ctypes.CDLL({str(renamed)!r})
        print("FOUND", _pinning._loaded_cudart())
        site = os.path.dirname(os.path.dirname(torch.__file__))
        paths = ["/usr/lib/libcudart.so.12", site + "/nvidia/cuda_runtime/lib/libcudart.so.13", "/x/libcudart.so"]
        print("TORCH", _pinning.cudart_in(paths) == paths[1], _pinning.cudart_in(["/usr/lib/libcudartx.so"]))
    """,
        prelude=LOAD,
    )
    assert f"FOUND {renamed}" in out and "TORCH True None" in out, out
