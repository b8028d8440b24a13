"""Tests of the native core, fastfeed._C: shared-memory segments and leases."""

from __future__ import annotations

import errno
import gc
import os
import secrets
import sys

import numpy as np
import pytest
import torch

from fastfeed import _C

SHM_DIR = "/dev/shm"
PAGE = os.sysconf("SC_PAGESIZE")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def new_name():
    """Hands out fresh segment names; teardown unlinks them and checks none is left."""
    names = []

    def make() -> str:
        names.append(f"/fastfeed-{os.getpid()}-test-{secrets.token_hex(8)}")  # the maker's pid where _leaks reads it
        return names[-1]

    yield make
    for name in names:
        _C.unlink(name)
        assert not os.path.exists(SHM_DIR + name)


def _wait_child(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- Segment -------------------------------------------------------------------------


def test_create_and_attach_share_bytes(new_name):
    """Bytes written through one mapping are read through another mapping of the same name."""
    name = new_name()
    a = _C.Segment.create(name, 3 * PAGE)
    b = _C.Segment.attach(name)
    memoryview(a)[PAGE + 1] = 42
    assert memoryview(b)[PAGE + 1] == 42
    assert b.size == a.size == 3 * PAGE


def test_create_is_exclusive(new_name):
    """Creating a name that already exists raises FileExistsError naming the segment."""
    name = new_name()
    keep = _C.Segment.create(name, PAGE)
    with pytest.raises(FileExistsError, match=name):
        _C.Segment.create(name, PAGE)
    assert keep.size == PAGE


def test_create_makes_mode_0600(new_name):
    """A created segment is readable and writable by its owner only."""
    name = new_name()
    _C.Segment.create(name, PAGE)
    st = os.stat(SHM_DIR + name)
    assert st.st_mode & 0o777 == 0o600
    assert st.st_uid == os.geteuid()


def test_name_without_leading_slash_is_normalised(new_name):
    """A name given without its leading slash gets one."""
    name = new_name()
    seg = _C.Segment.create(name.lstrip("/"), PAGE)
    assert seg.name == name
    assert _C.Segment.attach(name.lstrip("/")).name == name


def test_relative_path_and_directory_names_are_rejected():
    """A relative path, or a name ending in '/', raises ValueError."""
    with pytest.raises(ValueError):
        _C.Segment.create("fastfeed-test/x", PAGE)
    with pytest.raises(ValueError):
        _C.Segment.create("/fastfeed-test/", PAGE)


def test_an_absolute_path_makes_a_file_backed_segment(tmp_path):
    """An absolute path creates the segment as a 0600 file there (FASTFEED_SHM_DIR), shared by attach."""
    path = str(tmp_path / f"fastfeed-test-{secrets.token_hex(4)}")
    seg = _C.Segment.create(path, PAGE)
    assert os.stat(path).st_mode & 0o777 == 0o600
    memoryview(seg)[:3] = b"abc"
    assert bytes(memoryview(_C.Segment.attach(path))[:3]) == b"abc"
    with pytest.raises(FileExistsError):
        _C.Segment.create(path, PAGE)
    assert _C.unlink(path) and not _C.unlink(path)


def test_a_symlink_is_never_followed(tmp_path):
    """A planted symlink at a segment's path is refused, so nobody can redirect our writes."""
    target = tmp_path / "target"
    target.write_bytes(b"x" * PAGE)
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError):
        _C.Segment.attach(str(link))
    with pytest.raises(OSError):
        _C.Segment.create(str(link), PAGE)


@pytest.mark.parametrize("size", [0, -1])
def test_create_rejects_non_positive_size(new_name, size):
    """A segment of size <= 0 raises ValueError and creates nothing."""
    name = new_name()
    with pytest.raises(ValueError, match=name):
        _C.Segment.create(name, size)
    assert not os.path.exists(SHM_DIR + name)


def test_properties_describe_the_mapping(new_name):
    """size, len() and address describe the mapping that the buffer protocol exports."""
    seg = _C.Segment.create(new_name(), 2 * PAGE, hugepage=False)
    arr = np.frombuffer(seg, dtype=np.uint8)
    assert len(seg) == seg.size == arr.size == 2 * PAGE
    assert seg.address == arr.ctypes.data
    assert arr.flags.writeable


def test_properties_are_read_only(new_name):
    """Assigning to name, size or address raises AttributeError."""
    seg = _C.Segment.create(new_name(), PAGE)
    for attr in ("name", "size", "address", "numa_bound"):
        with pytest.raises(AttributeError):
            setattr(seg, attr, 1)


def test_torch_frombuffer_reads_segment_bytes(new_name):
    """torch.frombuffer over a segment is a writable uint8 view of its bytes."""
    seg = _C.Segment.create(new_name(), PAGE)
    t = torch.frombuffer(seg, dtype=torch.uint8)
    t[7] = 9
    assert t.numel() == PAGE
    assert memoryview(seg)[7] == 9


def test_unlink_returns_true_then_false(new_name):
    """unlink removes an existing name (True) and reports a missing one (False)."""
    name = new_name()
    _C.Segment.create(name, PAGE)
    assert _C.unlink(name) is True
    assert _C.unlink(name) is False


def test_mapping_survives_unlink(new_name):
    """An unlinked segment stays usable through mappings that already exist."""
    name = new_name()
    seg = _C.Segment.create(name, PAGE)
    _C.unlink(name)
    memoryview(seg)[0] = 1
    assert memoryview(seg)[0] == 1


def test_attach_missing_raises_file_not_found(new_name):
    """Attaching a name that does not exist raises FileNotFoundError naming it."""
    name = new_name()
    with pytest.raises(FileNotFoundError, match=name):
        _C.Segment.attach(name)


def test_attach_refuses_segment_open_to_others(new_name):
    """A segment with group or other permission bits is refused with PermissionError."""
    name = new_name()
    fd = os.open(SHM_DIR + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.fchmod(fd, 0o644)  # the umask may have cleared bits we need set
        os.ftruncate(fd, PAGE)
    finally:
        os.close(fd)
    with pytest.raises(PermissionError, match=f"{name}.*0644"):
        _C.Segment.attach(name)


def test_absurd_size_raises_oserror_and_leaves_no_name(new_name):
    """A size no machine can map raises OSError with the name and size, and unlinks the name."""
    name, size = new_name(), 1 << 60
    with pytest.raises(OSError) as info:
        _C.Segment.create(name, size)
    assert name in str(info.value) and str(size) in str(info.value)
    assert not os.path.exists(SHM_DIR + name)


def test_full_dev_shm_raises_enospc_at_create(new_name):
    """A segment larger than /dev/shm fails at create with ENOSPC, not later with SIGBUS."""
    st = os.statvfs(SHM_DIR)
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit")
    name, size = new_name(), 2 * st.f_blocks * st.f_frsize
    with pytest.raises(OSError) as info:
        _C.Segment.create(name, size)
    assert info.value.errno == errno.ENOSPC
    assert name in str(info.value) and str(size) in str(info.value)
    assert not os.path.exists(SHM_DIR + name)


def test_failed_calls_leak_no_file_descriptor(new_name):
    """create and attach close their descriptors on every error path."""
    name = new_name()
    keep = _C.Segment.create(name, PAGE)
    before = _open_fds()
    for call in (
        lambda: _C.Segment.create(name, PAGE),
        lambda: _C.Segment.create(new_name(), 1 << 60),
        lambda: _C.Segment.attach(new_name()),
    ):
        with pytest.raises(OSError):
            call()
    assert _open_fds() == before
    assert keep.size == PAGE


def test_segment_holds_no_file_descriptor(new_name):
    """A live segment keeps its memory through the mapping, not through an open descriptor."""
    before = _open_fds()
    segs = [_C.Segment.create(new_name(), PAGE) for _ in range(4)]
    segs.append(_C.Segment.attach(segs[0].name))
    assert _open_fds() == before


def test_numa_bind_failure_is_reported_not_raised(new_name):
    """A NUMA node that does not exist leaves numa_bound False and the segment usable."""
    seg = _C.Segment.create(new_name(), PAGE, numa_node=4095)
    assert seg.numa_bound is False
    memoryview(seg)[0] = 1
    assert _C.Segment.create(new_name(), PAGE).numa_bound is False


def test_numa_bind_to_node_0(new_name):
    """Binding to node 0 succeeds wherever the kernel has NUMA support."""
    if not os.path.exists("/sys/devices/system/node/node0"):
        pytest.skip("kernel without NUMA support")
    seg = _C.Segment.create(new_name(), 4 * PAGE, numa_node=0)
    assert seg.numa_bound is True


def test_forked_child_attaches_by_name_and_writes(new_name):
    """A forked child that attaches by name writes bytes the parent then reads."""
    name = new_name()
    seg = _C.Segment.create(name, PAGE)
    pid = os.fork()
    if pid == 0:  # child: no pytest, no exceptions escaping
        code = 1
        try:
            memoryview(_C.Segment.attach(name))[:3] = b"abc"
            code = 0
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    assert bytes(memoryview(seg)[:3]) == b"abc"


def test_forked_child_writes_through_inherited_mapping(new_name):
    """A forked child's writes through the inherited mapping reach the parent."""
    seg = _C.Segment.create(new_name(), PAGE)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            memoryview(seg)[PAGE - 1] = 77
            code = 0
        finally:
            os._exit(code)
    assert _wait_child(pid) == 0
    assert memoryview(seg)[PAGE - 1] == 77


# --- Lease ---------------------------------------------------------------------------


def test_lease_exports_segment_bytes(new_name):
    """A lease exports the same writable bytes as its segment."""
    seg = _C.Segment.create(new_name(), PAGE)
    lease = _C.Lease(seg, lambda: None)
    t = torch.frombuffer(lease, dtype=torch.uint8)
    t[3] = 5
    assert memoryview(seg)[3] == 5
    assert t.data_ptr() == seg.address and t.numel() == seg.size
    assert lease.segment is seg


def test_lease_views_keep_mapping_alive(new_name):
    """Tensors from a lease stay readable and writable after the segment and lease are dropped."""
    name = new_name()
    seg = _C.Segment.create(name, PAGE)
    t = torch.frombuffer(_C.Lease(seg, lambda: None), dtype=torch.uint8)
    del seg
    gc.collect()
    t[:] = 11
    assert memoryview(_C.Segment.attach(name))[PAGE // 2] == 11
    assert int(t.sum()) == 11 * PAGE


def test_lease_callback_fires_once_after_last_view(new_name):
    """on_release runs exactly once, only after the last view (slice or dtype view) dies."""
    calls = []
    seg = _C.Segment.create(new_name(), PAGE)
    lease = _C.Lease(seg, lambda: calls.append(1))
    whole = torch.frombuffer(lease, dtype=torch.uint8)
    part = whole[16:32]
    words = whole.view(torch.int32)
    del lease, seg
    del whole
    gc.collect()
    assert calls == []
    del part
    gc.collect()
    assert calls == []
    words[0] = 1
    del words
    gc.collect()
    assert calls == [1]


def test_lease_callback_runs_with_lease_buffer_released(new_name):
    """on_release runs when the last memoryview over the lease is released."""
    calls = []
    seg = _C.Segment.create(new_name(), PAGE)
    view = memoryview(_C.Lease(seg, lambda: calls.append(1)))
    assert calls == []
    view.release()
    assert calls == [1]


def test_raising_callback_is_reported_as_unraisable(new_name, monkeypatch):
    """An exception from on_release goes to sys.unraisablehook instead of crashing or propagating."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    def boom():
        raise RuntimeError("release failed")

    seg = _C.Segment.create(new_name(), PAGE)
    t = torch.frombuffer(_C.Lease(seg, boom), dtype=torch.uint8)
    del t
    gc.collect()
    assert len(seen) == 1
    assert isinstance(seen[0].exc_value, RuntimeError)
    assert "release failed" in str(seen[0].exc_value)


def test_lease_requires_callable(new_name):
    """A lease whose on_release is not callable raises TypeError."""
    seg = _C.Segment.create(new_name(), PAGE)
    with pytest.raises(TypeError):
        _C.Lease(seg, 42)


def test_lease_requires_segment():
    """A lease over anything but a Segment raises TypeError."""
    with pytest.raises(TypeError):
        _C.Lease(bytearray(8), lambda: None)


# --- gather: the hot copy into slots -----------------------------------------------------


@pytest.mark.parametrize("sizes", [[0], [1, 15, 17], [16 * 1024], [100_003, 64, 200_000, 33]])
@pytest.mark.parametrize("dst_offset", [0, 1, 13])
def test_gather_copies_every_source_back_to_back(sizes, dst_offset):
    """gather writes each source's bytes, in order, at consecutive destination bytes, whatever the alignment."""
    srcs = [torch.randint(0, 256, (n + 3,), dtype=torch.uint8)[3:] for n in sizes]  # misaligned sources
    dst = torch.zeros(sum(sizes) + dst_offset + 8, dtype=torch.uint8)
    _C.gather(dst.data_ptr() + dst_offset, [(s.data_ptr(), s.nbytes) for s in srcs])
    assert torch.equal(dst[dst_offset : dst_offset + sum(sizes)], torch.cat(srcs))
    assert not dst[:dst_offset].any() and not dst[dst_offset + sum(sizes) :].any()
