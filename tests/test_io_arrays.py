"""ArrayFiles (fixed-size records read with pread) against numpy.

The POSIX path is exercised for real: raw and .npy files, windows across files, errors, read_into, pickling,
worker processes and samplers. The GPUDirect Storage path is in test_io_gds.py.
"""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import fastfeed
from fastfeed.io.arrays import ArrayFiles


@pytest.fixture
def arrays():
    """Makes ArrayFiles and closes them after the test, so their descriptors do not read as leaks."""
    made: list[ArrayFiles] = []

    def make(*args, **kwargs) -> ArrayFiles:
        made.append(ArrayFiles(*args, **kwargs))
        return made[-1]

    yield make
    for ds in made:
        ds.close()


def write_raw(path, array: np.ndarray) -> str:
    array.tofile(path)
    return str(path)


def write_npy(path, array: np.ndarray, version: tuple[int, int] = (1, 0)) -> str:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    return str(path)


def samples(ds: ArrayFiles) -> torch.Tensor:
    return torch.stack([ds[i] for i in range(len(ds))])


def batches(loader) -> list[torch.Tensor]:
    return [b.clone() for b in loader]


def assert_workers_match_one_process(loader, samples: int, batch_size: int) -> None:
    """``loader(num_workers)`` with 2 workers yields exactly the batches it yields with none."""
    single, parallel = batches(loader(0)), batches(loader(2))
    assert len(single) == len(parallel) == math.ceil(samples / batch_size)
    assert all(torch.equal(a, b) for a, b in zip(single, parallel))


def tokens(tmp_path, sizes: list[int], kinds: str) -> tuple[list[str], np.ndarray]:
    """uint16 token files of the given sizes ('r' raw, 'n' .npy per file), and their concatenation."""
    reference = np.random.default_rng(0).integers(0, 65535, sum(sizes), dtype=np.uint16)
    parts = np.split(reference, np.cumsum(sizes)[:-1])
    paths = [
        write_raw(tmp_path / f"t{i}.bin", part) if kind == "r" else write_npy(tmp_path / f"t{i}.npy", part)
        for i, (part, kind) in enumerate(zip(parts, kinds))
    ]
    return paths, reference


# --- POSIX reads ------------------------------------------------------------------------------------------

RECORDS = [(np.uint16, ()), (np.float32, (3, 4)), (np.int64, (5,)), (np.float16, ()), (torch.int32, (2, 3))]


def record_id(value) -> str:
    return getattr(value, "__name__", str(value))


@pytest.mark.parametrize("dtype,shape", RECORDS, ids=record_id)
def test_raw_records_match_numpy(tmp_path, arrays, dtype, shape):
    """Each record of a raw file is bit-identical to np.fromfile's, with the dtype and shape asked for."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else np.dtype(dtype)
    data = np.random.default_rng(1).integers(-1000, 1000, (17, *shape)).astype(np_dtype)
    ds = arrays(write_raw(tmp_path / "a.bin", data), dtype, shape)
    reference = np.fromfile(tmp_path / "a.bin", dtype=np_dtype).reshape(-1, *shape)
    got = samples(ds)
    assert len(ds) == 17 and got.shape == (17, *shape) and got.dtype == torch.from_numpy(reference).dtype
    assert np.array_equal(got.numpy().view(np.uint8), reference.view(np.uint8))


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
@pytest.mark.parametrize("dtype,shape", RECORDS[:3], ids=record_id)
def test_npy_records_match_np_load(tmp_path, arrays, dtype, shape, version):
    """A .npy file's records, read past its header (format 1.0 or 2.0), are bit-identical to np.load's."""
    data = np.random.default_rng(2).normal(size=(9, *shape)).astype(dtype)
    path = write_npy(tmp_path / "a.npy", data, version)
    got = samples(arrays(path, dtype, shape))
    assert np.array_equal(got.numpy().view(np.uint8), np.load(path).view(np.uint8))


def test_records_concatenate_across_raw_and_npy_files(tmp_path, arrays):
    """Sample i is global record i over the files in the given order, raw and .npy mixed."""
    paths, reference = tokens(tmp_path, [5, 7, 3], "rnr")
    assert np.array_equal(samples(arrays(paths, np.uint16, ())).numpy(), reference)


def test_windows_span_two_and_three_files(tmp_path, arrays):
    """Window i is records i..i+N-1 of the concatenation, including windows reaching across two and three files."""
    paths, reference = tokens(tmp_path, [10, 3, 8], "rnr")
    ds = arrays(paths, torch.uint16, (), window=6)
    assert len(ds) == 21 - 6 + 1
    expected = np.stack([reference[i : i + 6] for i in range(len(ds))])
    assert np.array_equal(samples(ds).numpy(), expected)
    files_touched = [len(ds.locate(i)) for i in range(len(ds))]
    assert 2 in files_touched and 3 in files_touched
    assert ds.locate(8) == [(0, 16, 4), (1, 128, 6), (2, 0, 2)]  # t1.npy's data starts after its 128-byte header


def test_len_with_and_without_window(tmp_path, arrays):
    """len is the record count, or records - window + 1 with a window (0 when the window is longer than the data)."""
    paths, _ = tokens(tmp_path, [4, 6], "rr")
    assert len(arrays(paths, np.uint16, ())) == 10
    assert len(arrays(paths, np.uint16, (), window=1)) == 10
    assert len(arrays(paths, np.uint16, (), window=10)) == 1
    assert len(arrays(paths, np.uint16, (), window=11)) == 0
    ds = arrays(paths, np.uint16, (2,))
    assert len(ds) == 5 and ds[-1].tolist() == ds[4].tolist()
    with pytest.raises(IndexError, match="index 5 is out of range for 5 samples"):
        ds[5]


def test_read_into_fills_a_preallocated_tensor(tmp_path, arrays):
    """read_into writes a batch into the given tensor's own memory, equal to stacking __getitem__'s samples."""
    paths, _ = tokens(tmp_path, [10, 3, 8], "nrn")
    ds = arrays(paths, np.uint16, (), window=4)
    indices = [0, 1, 2, 11, 7, 7, 17, 5]
    out = torch.full((len(indices), 4), 7, dtype=torch.uint16)
    pointer = out.data_ptr()
    assert ds.read_into(indices, out) is out and out.data_ptr() == pointer
    assert torch.equal(out, torch.stack([ds[i] for i in indices]))
    flat = arrays(paths, np.uint16, ())
    assert len(flat.ranges([3, 4, 5, 6])) == 1  # samples contiguous in file and batch: one read


def test_read_into_rejects_a_mismatched_tensor(tmp_path, arrays):
    """read_into refuses a tensor of the wrong dtype, shape or layout rather than scribbling over it."""
    paths, _ = tokens(tmp_path, [8], "r")
    ds = arrays(paths, np.uint16, (2,))
    for bad in (torch.empty(2, 2, dtype=torch.int16), torch.empty(3, 2, dtype=torch.uint16),
                torch.empty(2, 2, dtype=torch.uint16).t()):
        with pytest.raises(ValueError, match="contiguous CPU tensor of dtype torch.uint16 and shape"):
            ds.read_into([0, 1], bad)


# --- errors ----------------------------------------------------------------------------------------------


def test_raw_size_not_a_multiple_of_the_record(tmp_path):
    """A raw file whose size is not a whole number of records is refused, naming the file and its size."""
    path = write_raw(tmp_path / "odd.bin", np.zeros(7, np.uint16))
    with pytest.raises(ValueError, match=r"odd\.bin: its size, 14 bytes, is not a multiple of the record size \(8"):
        ArrayFiles(path, np.uint16, (4,))


def test_npy_dtype_shape_and_order_mismatches(tmp_path):
    """A .npy file with another dtype, record shape or Fortran order is refused, naming the file."""
    path = write_npy(tmp_path / "a.npy", np.zeros((4, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"a\.npy: the array's dtype is float32, expected torch.float64"):
        ArrayFiles(path, np.float64, (3, 4))
    with pytest.raises(ValueError, match=r"a\.npy: the array's shape is \(4, 3, 4\), expected \(N, 4, 3\)"):
        ArrayFiles(path, np.float32, (4, 3))
    fortran = write_npy(tmp_path / "f.npy", np.asfortranarray(np.zeros((4, 3), np.float32)))
    with pytest.raises(ValueError, match=r"f\.npy: the array is in Fortran order"):
        ArrayFiles(fortran, np.float32, (3,))


def test_missing_file(tmp_path):
    """A missing file raises FileNotFoundError naming its path, at construction."""
    present = write_raw(tmp_path / "a.bin", np.zeros(4, np.uint16))
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        ArrayFiles([present, tmp_path / "nope.bin"], np.uint16, ())


def test_truncated_npy_at_construction(tmp_path):
    """A .npy file shorter than its header says is an OSError naming the file, offset and sizes."""
    path = write_npy(tmp_path / "a.npy", np.zeros(100, np.int32))
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(OSError, match=r"a\.npy: truncated: .*100 records of 4 bytes from offset 128 \(528 bytes"
                                      r" in all\), but the file is 518 bytes"):
        ArrayFiles(path, np.int32, ())


def test_file_truncated_after_opening_gives_a_short_read(tmp_path, arrays):
    """A file that shrinks under the dataset gives an OSError naming the file, offset and sizes, not garbage."""
    path = write_raw(tmp_path / "a.bin", np.arange(64, dtype=np.int32))
    ds = arrays(path, np.int32, (8,))
    assert ds[0].tolist() == list(range(8))
    os.truncate(path, 200)
    with pytest.raises(OSError, match=r"a\.bin: short read at offset 192: wanted 32 bytes, got 8; the file is now 200"):
        ds[6]


def test_bad_arguments():
    """Empty file lists, empty records and bad windows are refused up front."""
    with pytest.raises(ValueError, match="at least one file"):
        ArrayFiles([], np.uint8, ())
    with pytest.raises(ValueError, match="holds no bytes"):
        ArrayFiles("x.bin", np.uint8, (0,))
    with pytest.raises(ValueError, match="window must be a positive int"):
        ArrayFiles("x.bin", np.uint8, (), window=0)


# --- processes and samplers --------------------------------------------------------------------------------


def test_pickle_drops_descriptors_and_reopens(tmp_path, arrays):
    """A pickled dataset carries no descriptors; its copy reopens the files and reads the same samples."""
    paths, _ = tokens(tmp_path, [10, 3, 8], "rnr")
    ds = arrays(paths, np.uint16, (), window=5)
    before = samples(ds)  # opens the descriptors here
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._fds == [] and copy._pid is None
    try:
        assert torch.equal(samples(copy), before)
    finally:
        copy.close()


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_torch_dataloader_workers_match_single_process(tmp_path, arrays, context):
    """torch's DataLoader with two forked or spawned workers yields the batches of num_workers=0, same seed."""
    paths, _ = tokens(tmp_path, [50, 30, 20], "rnr")
    ds = arrays(paths, np.uint16, (), window=8)
    ds[0]  # descriptors open in the parent before the workers start

    def loader(workers: int) -> tud.DataLoader:
        extra = {"multiprocessing_context": context} if workers else {}
        return tud.DataLoader(ds, batch_size=16, shuffle=True, num_workers=workers,
                              generator=torch.Generator().manual_seed(5), **extra)

    assert_workers_match_one_process(loader, len(ds), 16)


def test_fastfeed_dataloader_shuffled_workers_match_single_process(tmp_path, arrays):
    """fastfeed.DataLoader(num_workers=2, shuffle=True) yields the batches of num_workers=0 with the same seed."""
    paths, _ = tokens(tmp_path, [60, 45], "nr")
    ds = arrays(paths, np.uint16, (), window=16)

    def loader(workers: int) -> fastfeed.DataLoader:
        return fastfeed.DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                   generator=torch.Generator().manual_seed(9))

    assert_workers_match_one_process(loader, len(ds), 8)


def test_distributed_sampler_shards_cover_the_dataset(tmp_path, arrays):
    """DistributedSampler's two shards together cover every sample, and each index reads its own window."""
    paths, reference = tokens(tmp_path, [20, 17], "rn")
    ds = arrays(paths, np.uint16, (), window=3)
    seen = set()
    for rank in (0, 1):
        sampler = tud.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=4)
        indices = list(sampler)
        loaded = torch.cat(batches(tud.DataLoader(ds, batch_size=4, sampler=sampler)))
        assert np.array_equal(loaded.numpy(), np.stack([reference[i : i + 3] for i in indices]))
        seen.update(indices)
    assert seen == set(range(len(ds)))
