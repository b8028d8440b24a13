"""The GPUDirect Storage path: GdsReader and DataLoader(reader="gds") against a fake kvikio and a fake device.

GDS needs a driver, a GPU and kvikio, none of which exist here. The fake ``kvikio`` module's ``CuFile`` logs each
call (and the thread it came from) and fills the (CPU) destination from the real file when its future is waited
on. ``FakeDevice`` stands in for CUDA streams and events: copies are queued and run only when something waits for
them, and work queued on the consumer's stream (a checksum "kernel" that reads raw memory, as a GPU would, without
keeping the batch alive) runs only when a wait needs it or the test says so. A buffer rewritten before its
consumer's work ran, or a read handed over before its copies ran, shows up as a wrong checksum.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
import sys
import threading
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import fastfeed
from fastfeed.io import direct, gds
from fastfeed.tuning import offline
from test_io_arrays import arrays, samples, tokens, write_raw  # noqa: F401 (arrays is a fixture)

PAGE = 4096
READER_THREAD = "fastfeed-gds-reader"


@dataclass
class Pread:
    path: str
    size: int
    file_offset: int
    pointer: int  # where in (stand-in) device memory the read lands


@dataclass
class KvikioLog:
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    preads: list[Pread] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)  # names of the threads that called pread
    fail: set[tuple[str, int]] = field(default_factory=set)  # (path, file_offset) of reads that fail
    settings: dict = field(default_factory=lambda: {"compat_mode": False, "gds_threshold": 0, "num_threads": 1})


def fake_kvikio(log: KvikioLog, api: str = "new") -> types.ModuleType:
    """A kvikio module whose CuFile has the real signatures, logs calls and fills CPU tensors from the file when
    the read's future is waited on (not before: the read is in flight until then). ``api``: its ``defaults`` as
    in kvikio >= 25.04 (``get``/``set``), up to 24.12 (``gds_threshold()``, ``num_threads_reset(n)``) or none."""

    class Future:
        def __init__(self, read):
            self.read = read

        def get(self) -> int:
            return self.read()

    class CuFile:
        def __init__(self, path: str, flags: str = "r"):
            assert flags == "r"
            self.path, self.fd = path, os.open(path, os.O_RDONLY)
            log.opened.append(path)

        def pread(self, buf, size=None, file_offset=0, task_size=None) -> Future:
            assert isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.is_contiguous()
            size = buf.numel() if size is None else size
            assert size <= buf.numel()
            log.preads.append(Pread(self.path, size, file_offset, buf.data_ptr()))
            log.threads.add(threading.current_thread().name)

            def read() -> int:
                if (self.path, file_offset) in log.fail:
                    raise RuntimeError("cuFileRead: input/output error")
                data = os.pread(self.fd, size, file_offset)
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                return len(data)

            return Future(read)

        def close(self) -> None:
            os.close(self.fd)
            log.closed.append(self.path)

    module = types.ModuleType("kvikio")
    module.CuFile = CuFile
    settings = log.settings
    if api == "new":
        module.defaults = types.SimpleNamespace(get=settings.__getitem__, set=settings.__setitem__)
    elif api == "old":
        module.defaults = types.SimpleNamespace(
            compat_mode=lambda: settings["compat_mode"], gds_threshold=lambda: settings["gds_threshold"],
            get_num_threads=lambda: settings["num_threads"],
            num_threads_reset=lambda n: settings.__setitem__("num_threads", n))
    return module


@pytest.fixture
def kvikio_log(monkeypatch) -> KvikioLog:
    """Installs the fake kvikio (threshold 0: every read goes through "cuFile") and makes available() see a driver
    and a CUDA device."""
    log = KvikioLog()
    monkeypatch.setitem(sys.modules, "kvikio", fake_kvikio(log))
    monkeypatch.setattr(gds, "_libcuda_loads", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    return log


def test_posix_path_never_imports_kvikio(tmp_path, arrays):
    """Reading with ArrayFiles and choosing a reader without GDS leave kvikio unimported."""
    if "kvikio" in sys.modules:
        pytest.skip("kvikio was already imported by something else")
    paths, _ = tokens(tmp_path, [8], "n")
    samples(arrays(paths, np.uint16, (), window=2))
    assert gds.choose("posix") == "posix"
    if not gds.available()[0]:
        assert gds.choose("auto") == "posix"
    assert "kvikio" not in sys.modules


def test_available_says_why_not_here():
    """Without kvikio or a driver, available() is False and names what is missing."""
    ok, why = gds.available()
    if ok:
        pytest.skip("GPUDirect Storage is available on this machine")
    assert "kvikio is not installed" in why or "libcuda.so.1" in why or "torch.cuda" in why


def test_choose_without_gds(monkeypatch):
    """Without a driver, "auto" picks posix, "gds" raises saying why and suggesting posix, others are refused."""
    monkeypatch.setattr(gds, "_libcuda_loads", lambda: False)
    assert gds.choose("auto") == "posix"
    assert gds.choose("posix") == "posix"
    with pytest.raises(RuntimeError, match=r"reader='gds', but .*libcuda\.so\.1 does not load.*Use reader='posix'"):
        gds.choose("gds")
    with pytest.raises(ValueError, match="choose one of 'auto', 'gds', 'posix'"):
        gds.choose("nvme")


def test_gds_reader_refuses_without_gds(tmp_path, arrays, monkeypatch):
    """GdsReader will not start (nor import kvikio) where GDS cannot work."""
    monkeypatch.setattr(gds, "_libcuda_loads", lambda: False)
    paths, _ = tokens(tmp_path, [8], "r")
    with pytest.raises(RuntimeError, match="GPUDirect Storage cannot work here: .*libcuda"):
        gds.GdsReader(arrays(paths, np.uint16, ()))


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor starting on a page boundary, standing in for a fresh device allocation."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def test_gds_aligned_records_read_straight_into_the_batch(tmp_path, arrays, kvikio_log):
    """Page-sized records: one pread per contiguous range, straight into an aligned batch, files opened once."""
    data = np.random.default_rng(3).normal(size=(9, 1024)).astype(np.float32)  # 4 KiB records
    paths = [write_raw(tmp_path / "a.bin", data[:5]), write_raw(tmp_path / "b.bin", data[5:])]
    ds = arrays(paths, np.float32, (1024,))
    assert gds.choose("auto") == "gds"
    with gds.GdsReader(ds) as reader:
        indices = [0, 1, 2, 6, 7, 8, 4]
        out = page_aligned_empty((len(indices), 1024), torch.float32)
        reader.read_batch(indices, out)
        assert torch.equal(out, torch.stack([ds[i] for i in indices]))
        base = out.data_ptr()
        assert kvikio_log.preads == [
            Pread(paths[0], 3 * PAGE, 0, base),
            Pread(paths[1], 3 * PAGE, PAGE, base + 3 * PAGE),
            Pread(paths[0], PAGE, 4 * PAGE, base + 6 * PAGE),
        ]
        assert reader.stats == {"batches": 1, "aligned": 3, "widened": 0, "posix": 0, "bytes_wanted": 7 * PAGE,
                                "bytes_read": 7 * PAGE}
        misaligned = page_aligned_empty((3, 1024), torch.float32).view(-1)[16 : 16 + 2048].view(2, 1024)
        reader.read_batch([3, 5], misaligned)  # the batch itself is off a page: both reads go through scratch
        assert torch.equal(misaligned, torch.stack([ds[3], ds[5]]))
        assert reader.stats["aligned"] == 3 and reader.stats["widened"] == 2
        assert kvikio_log.opened == paths
    assert sorted(kvikio_log.closed) == sorted(paths)


def test_gds_unaligned_windows_are_widened_to_pages(tmp_path, arrays, kvikio_log):
    """Token windows at odd offsets are read as whole pages into aligned scratch and match __getitem__ exactly."""
    window = 2049  # 4098 bytes: no window is page-aligned at both ends
    paths, _ = tokens(tmp_path, [3000, 5000, 2500], "nrn")
    ds = arrays(paths, np.uint16, (), window=window)
    indices = [0, 2999, 10, len(ds) - 1, 6000, 2500, 2500, 7001]  # across files, up to the data's last token
    out = page_aligned_empty((len(indices), window), torch.uint16)
    with gds.GdsReader(ds) as reader:
        reader.read_batch(indices, out)
        ranges = ds.ranges(indices)
        assert torch.equal(out, torch.stack([ds[i] for i in indices]))
        assert len(kvikio_log.preads) == len(ranges)  # one pread per contiguous range
        sizes = {path: os.path.getsize(path) for path in paths}
        for call in kvikio_log.preads:
            assert call.file_offset % PAGE == 0 and call.pointer % PAGE == 0
            assert call.size % PAGE == 0 or call.file_offset + call.size == sizes[call.path]
        assert reader.stats["aligned"] == 0 and reader.stats["widened"] == len(ranges)
        assert reader.stats["bytes_wanted"] == len(indices) * window * 2 < reader.stats["bytes_read"]
        assert kvikio_log.opened == paths


def gds_loader(ds, **kwargs) -> fastfeed.DataLoader:
    """DataLoader(reader="gds") with a CPU tensor standing in for device memory: device="cpu" gives the device
    stage's arguments (device_transform, device_prefetch) as device="cuda" would on a GPU."""
    loader = fastfeed.DataLoader(ds, reader="posix", device="cpu", **kwargs)
    loader._read_direct()
    return loader


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == READER_THREAD]


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_the_loaders_gds_path_yields_the_posix_batches_and_resumes(tmp_path, arrays, kvikio_log, ahead):
    """DataLoader(reader="gds", device_prefetch=ahead): the same shuffled batches as the usual path, read in the
    reader thread, no worker started, and state_dict() taken while batches are read ahead resumes exactly there."""
    paths, _ = tokens(tmp_path, [3000, 5000], "rr")
    ds = arrays(paths, np.uint16, (), window=257)
    torch.manual_seed(5)
    expected = [b.clone() for b in fastfeed.DataLoader(ds, batch_size=8, shuffle=True)]
    torch.manual_seed(5)
    loader = gds_loader(ds, batch_size=8, shuffle=True, num_workers=2, device_prefetch=ahead)
    it = iter(loader)
    assert type(it).__name__ == "GdsIter" and loader.num_workers == 0
    got = [next(it).clone() for _ in range(3)]
    state = loader.state_dict()
    assert state["yielded"] == 3  # the batches read ahead are not counted
    got += [b.clone() for b in it]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert kvikio_log.threads == {READER_THREAD}  # every read ran in the reader thread, none in the loop's
    assert not reader_threads()  # the epoch's end stopped and joined it
    resumed = gds_loader(ds, batch_size=8, shuffle=True, device_prefetch=ahead)
    resumed.load_state_dict(state)
    rest = [b.clone() for b in resumed]
    assert all(torch.equal(a, b) for a, b in zip(rest, expected[3:])) and len(rest) == len(expected) - 3
    del it, loader, resumed
    gc.collect()
    assert sorted(kvikio_log.closed) == sorted(kvikio_log.opened)  # each epoch's reader closed its files


def test_reader_asks_for_arrayfiles_and_a_gpu_for_gds(tmp_path, arrays):
    """reader= on another dataset, an unknown reader, or GDS here are clear errors; "auto" without a GPU is POSIX."""

    paths, _ = tokens(tmp_path, [600], "r")
    ds = arrays(paths, np.uint16, (), window=16)
    assert fastfeed.DataLoader(ds, batch_size=4, reader="auto").reader == "posix"
    with pytest.raises(ValueError, match="reads fastfeed.io.ArrayFiles"):
        fastfeed.DataLoader(list(range(8)), reader="posix")
    with pytest.raises(ValueError, match="choose one of"):
        fastfeed.DataLoader(ds, reader="fast")
    with pytest.raises(RuntimeError, match="GPUDirect Storage cannot work here"):
        fastfeed.DataLoader(ds, batch_size=4, reader="gds")


# --- the read-ahead against a fake device ------------------------------------------------------------------------


def _raw(t: torch.Tensor):
    """What a GPU holds of a contiguous tensor: its address, not a reference that keeps it alive."""
    address, nbytes, dtype, shape = t.data_ptr(), t.nbytes, t.dtype, t.shape
    return lambda: torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8).view(
        dtype).view(shape)  # fmt: skip


@dataclass
class FakeEvent:
    stream: list  # the stream's ops
    at: int  # complete once that many of them ran


class FakeDevice:
    """direct.Device over CPU memory with two queues of work, the read stream and the consumer's stream: nothing
    queued runs until something waits for it (a wait, a hand-over's stream wait, or ``finish``)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.read_ops: list = []
        self.consumer_ops: list = []
        self.ran = {id(self.read_ops): 0, id(self.consumer_ops): 0}
        self.local = threading.local()

    def _current(self) -> list:
        return getattr(self.local, "stream", self.consumer_ops)

    def _run_to(self, ops: list, n: int) -> None:
        with self.lock:
            while self.ran[id(ops)] < n:
                op = ops[self.ran[id(ops)]]
                self.ran[id(ops)] += 1
                op()

    def finish(self) -> None:
        """Run everything queued on both streams."""
        with self.lock:
            self._run_to(self.consumer_ops, len(self.consumer_ops))
            self._run_to(self.read_ops, len(self.read_ops))

    def kernel(self, batch: torch.Tensor, seen: dict, key) -> None:
        """Queue, on the consumer's stream, a kernel that copies what ``batch``'s memory holds when it runs."""
        raw = _raw(batch)
        with self.lock:
            self.consumer_ops.append(lambda: seen.__setitem__(key, raw().clone()))

    @contextlib.contextmanager
    def reading(self):
        self.local.stream = self.read_ops
        try:
            yield
        finally:
            del self.local.stream

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        t, s = _raw(target), _raw(source)
        with self.lock:
            self._current().append(lambda: t().copy_(s()))

    def run(self, fn, batch):
        self._run_to(self.read_ops, len(self.read_ops))  # a transform queued after the copies runs after them
        return fn(batch)

    def record(self) -> FakeEvent:
        with self.lock:
            return FakeEvent(self.read_ops, len(self.read_ops))

    def consumed(self) -> FakeEvent:
        with self.lock:
            ops = self._current()
            return FakeEvent(ops, len(ops))

    def wait(self, event) -> None:
        if event is not None:
            self._run_to(event.stream, event.at)

    def hand_over(self, out, event, memory) -> None:
        with self.lock:
            self.consumer_ops.append(lambda: self._run_to(event.stream, event.at))

    def lend(self, memory, on_free):
        return direct.HostDevice().lend(memory, on_free)


@pytest.fixture
def fake_device(monkeypatch) -> FakeDevice:
    """The device every GDS iterator gets."""
    device = FakeDevice()
    monkeypatch.setattr(direct, "device_for", lambda _: device)
    return device


def odd_windows(tmp_path, arrays):
    """Token windows of 4098 bytes: every read is misaligned, so it is widened through scratch and copied."""
    paths, _ = tokens(tmp_path, [3000, 5000], "rn")
    ds = arrays(paths, np.uint16, (), window=2049)
    return ds


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_gds_buffers_are_rewritten_only_after_the_consumers_work_on_them(
    tmp_path, arrays, kvikio_log, fake_device, ahead
):  # fmt: skip
    """Each batch's consumer kernel, queued and run only later, sees that batch's bytes: a pool buffer (and its
    scratch) is rewritten only once the consumer's work before the batch died has run, and the consumer's stream
    waits for the read's copies; the pool stays at device_prefetch + 2 buffers."""
    ds = odd_windows(tmp_path, arrays)
    expected = [b.clone() for b in tud.DataLoader(ds, batch_size=3, sampler=range(0, len(ds), 97))]
    loader = gds_loader(ds, batch_size=3, sampler=range(0, len(ds), 97), device_prefetch=ahead)
    it = iter(loader)
    seen: dict = {}
    for k in range(len(expected)):
        batch = next(it)
        fake_device.kernel(batch, seen, k)
        del batch  # dies with its kernel still queued, as a training step's last use of it would
    with pytest.raises(StopIteration):
        next(it)
    fake_device.finish()
    assert sorted(seen) == list(range(len(expected)))
    assert all(torch.equal(seen[k], expected[k]) for k in seen)
    stats = it.gds_stats()
    assert stats["widened"] > 0 and stats["aligned"] == 0 and stats["pool"] <= ahead + 2
    assert len(expected) > ahead + 2  # buffers were reused


def test_gds_batches_held_are_never_rewritten(tmp_path, arrays, kvikio_log, fake_device):
    """list(loader) keeps every batch intact: the pool grows instead of rewriting a buffer still viewed."""
    ds = odd_windows(tmp_path, arrays)
    expected = [b.clone() for b in tud.DataLoader(ds, batch_size=4, sampler=range(0, len(ds), 211))]
    loader = gds_loader(ds, batch_size=4, sampler=range(0, len(ds), 211))
    it = iter(loader)
    held = list(it)
    fake_device.finish()
    assert len(held) == len(expected) and all(torch.equal(a, b) for a, b in zip(held, expected))
    assert it.gds_stats()["pool"] == len(expected)


class CountingSampler(tud.Sampler):
    """Batches of 2 sequential indices, counting how many batches were drawn."""

    def __init__(self, n: int):
        self.n, self.drawn = n, 0

    def __iter__(self):
        for i in range(0, self.n - 1, 2):
            self.drawn += 1
            yield [i, i + 1]

    def __len__(self):
        return self.n // 2


@pytest.mark.parametrize("ahead", [1, 3])
def test_gds_applies_device_transform_and_reads_device_prefetch_ahead(tmp_path, arrays, kvikio_log, ahead):
    """reader="gds" runs device_transform on every batch (in the reader thread, where its read stream is current)
    and reads device_prefetch batches beyond the one handed over: neither is dropped."""
    paths, _ = tokens(tmp_path, [400], "r")
    ds = arrays(paths, np.uint16, (), window=16)
    sampler = CountingSampler(len(ds))
    ran_in = set()

    def transform(batch):
        ran_in.add(threading.current_thread().name)
        return batch.to(torch.int32) * 2 + 1

    expected = [torch.stack([ds[i], ds[i + 1]]).to(torch.int32) * 2 + 1 for i in range(0, len(ds) - 1, 2)]
    it = iter(gds_loader(ds, batch_sampler=sampler, device_prefetch=ahead, device_transform=transform))
    first = next(it)
    assert first.dtype == torch.int32 and torch.equal(first, expected[0])  # transformed
    assert sampler.drawn == 1 + ahead  # the batch handed over and those being read
    got = [first.clone()] + [b.clone() for b in it]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert ran_in == {READER_THREAD}


def test_gds_read_errors_surface_at_their_own_batch(tmp_path, arrays, kvikio_log, fake_device):
    """A failed read raises at the next() that would have returned its batch, naming the file and offset; the
    batches before it (already handed over while it was read ahead) and after it come through."""
    data = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)  # 4 KiB records: one aligned read a batch
    path = write_raw(tmp_path / "a.bin", data)
    ds = arrays(path, np.float32, (1024,))
    kvikio_log.fail.add((path, 2 * 4 * PAGE))  # batch 2 of 4 records
    it = iter(gds_loader(ds, batch_size=4, device_prefetch=3))
    assert torch.equal(next(it), torch.from_numpy(data[0:4]))
    assert torch.equal(next(it), torch.from_numpy(data[4:8]))
    with pytest.raises(OSError, match=r"a\.bin: read of 16384 bytes at offset 32768 failed: cuFileRead"):
        next(it)
    assert torch.equal(next(it), torch.from_numpy(data[12:16]))
    assert len(list(it)) == 16 - 4


def test_gds_dropping_the_iterator_stops_its_reader_thread(tmp_path, arrays, kvikio_log):
    """An epoch's iterator left mid-epoch (a `break`) keeps its reader until the next epoch starts, which stops and
    joins it and closes its files first; dropping the loader stops the last one."""
    paths, _ = tokens(tmp_path, [3000], "r")
    ds = arrays(paths, np.uint16, (), window=100)
    loader = gds_loader(ds, batch_size=8, device_prefetch=2)
    it = iter(loader)
    next(it)
    assert len(reader_threads()) == 1
    del it
    gc.collect()
    assert loader.state_dict()["yielded"] == 1  # the loader keeps it so that a state after `break` is exact
    first = list(reader_threads())
    assert len(next(iter(loader))) == 8  # a new epoch: the old reader is stopped and a new one started
    assert kvikio_log.closed == paths and not any(t in reader_threads() for t in first)
    del loader
    gc.collect()
    assert not reader_threads()
    assert kvikio_log.closed == kvikio_log.opened == paths * 2


def test_gds_sets_kvikios_threads_from_the_plan(tmp_path, arrays, kvikio_log, monkeypatch):
    """kvikio's thread pool (1 thread by default) gets this rank's CPUs, as the NUMA plan counts them."""
    asked = []

    def rank_cpus(base=None):
        asked.append(base)
        return 7

    monkeypatch.setattr(offline, "rank_cpus", rank_cpus)
    paths, _ = tokens(tmp_path, [300], "r")
    loader = gds_loader(arrays(paths, np.uint16, (), window=10), batch_size=4, numa="off")
    it = iter(loader)
    next(it)
    assert kvikio_log.settings["num_threads"] == 7 and it.gds_stats()["threads"] == 7
    assert asked == [{"device": torch.device("cpu"), "numa": "off"}]


@pytest.mark.parametrize("api", ["new", "old"])
def test_raise_threads_keeps_the_users_and_larger_pools(monkeypatch, api):
    """raise_threads grows kvikio's pool through either kvikio API, never shrinks it, and leaves KVIKIO_NTHREADS."""
    log = KvikioLog()
    kvikio = fake_kvikio(log, api)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    assert gds.raise_threads(kvikio, 6) == 6 == log.settings["num_threads"]
    assert gds.raise_threads(kvikio, 3) == 6  # another loader's larger pool stays
    monkeypatch.setenv("KVIKIO_NTHREADS", "2")
    assert gds.raise_threads(kvikio, 12) == 6
    assert gds.raise_threads(fake_kvikio(log, "none"), 12) is None


def test_gds_widens_only_reads_that_go_through_cufile(tmp_path, arrays, kvikio_log, monkeypatch):
    """Misaligned ranges under kvikio's GDS threshold, or in compat mode, are read as they are (kvikio sends them to
    POSIX); those at or over it are widened to pages."""
    paths, _ = tokens(tmp_path, [3000, 5000], "nr")
    ds = arrays(paths, np.uint16, (), window=2049)
    indices = [5, 3001, 700]
    out = page_aligned_empty((3, 2049), torch.uint16)
    for threshold, compat, kind in [(4098, False, "widened"), (4099, False, "posix"), (0, True, "posix")]:
        kvikio_log.settings.update(gds_threshold=threshold, compat_mode=compat)
        kvikio_log.preads.clear()
        with gds.GdsReader(ds) as reader:
            reader.read_batch(indices, out)
            assert torch.equal(out, torch.stack([ds[i] for i in indices]))
            assert reader.stats[kind] == 3 and reader.compat_mode is compat and reader.gds_threshold == threshold
        if kind == "posix":
            assert [(c.size, c.pointer) for c in kvikio_log.preads] == [(4098, out.data_ptr() + 4098 * k)
                                                                        for k in range(3)]  # fmt: skip
            assert reader.stats["bytes_read"] == reader.stats["bytes_wanted"]
    monkeypatch.setitem(sys.modules, "kvikio", fake_kvikio(kvikio_log, "none"))
    monkeypatch.setenv("KVIKIO_GDS_THRESHOLD", "5000")
    assert gds.GdsReader(ds).gds_threshold == 5000
    monkeypatch.delenv("KVIKIO_GDS_THRESHOLD")
    assert gds.GdsReader(ds).gds_threshold == gds.GDS_THRESHOLD == 1 << 20
