"""The standard CPU workloads, defined once: a dataset factory plus the loader kwargs.

See /work/shared/BENCHMARKS.md for the questions each workload answers. Datasets are
module-level classes built from a seeded generator, so they pickle under spawn and every
trial (candidate or torch) sees the same bytes.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

BATCH_SIZE = 64
IMAGE_SHAPE = (3, 224, 224)
# 256 images of 3x224x224 uint8 are ~38.5 MB: more than this machine's 32 MiB L3, so the
# transport figure measures memory bandwidth, not cache bandwidth. Raise it on bigger caches.
TRANSPORT_POOL_ITEMS = 256
# The jpeg workload's files: made once, then reused by every run (benchmarks/.cache is git-ignored).
JPEG_CACHE = Path(__file__).resolve().parent / ".cache"
JPEG_FILES = 512
JPEG_QUALITY = 90
JPEG_CROP = 224
JPEG_GENERATOR = 1  # bump when make_jpegs changes what it writes: the cache directory is named after it


class PoolDataset(Dataset):
    """Map-style dataset whose item ``i`` is ``pool[i % len(pool)]``, a pre-made tensor.

    Items are made once, up front, so ``__getitem__`` costs almost nothing and a benchmark
    measures the loader, not the dataset.

    Args:
        length: Number of items the dataset reports.
        shape: Shape of every item.
        dtype: NumPy dtype name of the items (``"uint8"``: uniform bytes, floats: normal).
        pool_items: Number of distinct pre-made items.
        seed: Seed of the generator, so every trial sees the same data.
    """

    def __init__(self, length: int, shape: tuple[int, ...], dtype: str, pool_items: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        if np.dtype(dtype).kind == "f":
            make = partial(rng.standard_normal, size=shape, dtype=dtype)
        else:
            make = partial(rng.integers, 0, 256, size=shape, dtype=dtype)
        # One tensor per item, as a real dataset would return, rather than views of one block.
        self.pool = [torch.from_numpy(make()) for _ in range(pool_items)]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.pool[index % len(self.pool)]


@dataclass(frozen=True)
class Workload:
    """A standard workload: how to build a fresh dataset and how to load it.

    Attributes:
        name: Workload id, as in BENCHMARKS.md.
        make_dataset: Called with the number of items a trial needs; returns a fresh dataset.
        loader_kwargs: Keyword arguments shared by candidate and torch loaders.
        unit: Throughput unit to report, ``"GB/s"`` or ``"batch/s"``.
        describe: JSON-able description, written to the results.
    """

    name: str
    make_dataset: Callable[[int], Dataset]
    loader_kwargs: dict[str, Any]
    unit: str
    describe: dict[str, Any] = field(default_factory=dict)


def transport(pool_items: int = TRANSPORT_POOL_ITEMS) -> Workload:
    """64 uint8 images of 3x224x224 per batch (9.6 MB): how fast do bytes reach the consumer?

    Args:
        pool_items: Number of distinct images; keep their total above the L3 cache size.

    Returns:
        The transport workload.
    """
    spec = dict(shape=IMAGE_SHAPE, dtype="uint8", pool_items=pool_items)
    return Workload(
        name="transport",
        make_dataset=partial(PoolDataset, **spec),
        loader_kwargs=dict(batch_size=BATCH_SIZE),
        unit="GB/s",
        describe=dict(spec, pool_mb=round(pool_items * np.prod(IMAGE_SHAPE) / 1e6, 1), batch_size=BATCH_SIZE),
    )


def overhead(pool_items: int = 1024) -> Workload:
    """16 float32 per item, 64 per batch: what does one batch cost, besides its bytes?

    Args:
        pool_items: Number of distinct pre-made items.

    Returns:
        The overhead workload.
    """
    spec = dict(shape=(16,), dtype="float32", pool_items=pool_items)
    return Workload(
        name="overhead",
        make_dataset=partial(PoolDataset, **spec),
        loader_kwargs=dict(batch_size=BATCH_SIZE),
        unit="batch/s",
        describe=dict(spec, batch_size=BATCH_SIZE),
    )


def startup(pool_items: int = TRANSPORT_POOL_ITEMS) -> Workload:
    """The transport dataset, measured for time to first batch and peak memory of a short run.

    Args:
        pool_items: Number of distinct images.

    Returns:
        The startup workload.
    """
    base = transport(pool_items)
    return Workload("startup", base.make_dataset, base.loader_kwargs, base.unit, base.describe)


# --- jpeg: generated JPEGs on disk, decoded with PIL in __getitem__ --------------------------


def _pil_image():
    """PIL's ``Image`` module, imported on first use: Pillow is a benchmark dependency only."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("the jpeg workload needs Pillow: .venv/bin/pip install pillow") from exc
    return Image


def _octave(rng: np.random.Generator, height: int, width: int, cell: int, channels: int) -> np.ndarray:
    """Uniform noise on a grid of ``cell``-pixel cells, bicubic-upsampled to the image, centred on 0."""
    Image = _pil_image()
    grid = rng.integers(0, 256, size=(max(2, height // cell), max(2, width // cell), channels), dtype=np.uint8)
    small = Image.fromarray(grid if channels == 3 else grid[..., 0])
    out = np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32) - 128
    return out if channels == 3 else out[..., None]


def make_jpegs(directory: Path, count: int = JPEG_FILES, seed: int = 0, quality: int = JPEG_QUALITY) -> None:
    """Write ``count`` photo-like JPEGs, ``00000.jpg``..., into ``directory`` (which must not exist).

    Sizes are drawn as ImageNet's typical ones: a long side of 400-500 px and a short side of
    320-375, landscape three times in four. The content is 1/f-like noise, colour at coarse scales
    and luminance down to 2-px detail, so at quality 90 a file is ~57 KB and decodes as a photo of
    its size does (libjpeg-turbo's time depends on pixels and coefficients, not on what they show).
    The same seed writes the same pixels; the bytes also depend on the JPEG encoder's version.

    Args:
        directory: Where to write; made here, with its parents.
        count: Number of files.
        seed: Seed of the generator.
        quality: JPEG quality.
    """
    Image = _pil_image()
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True)
    for i in range(count):
        long, short = int(rng.integers(400, 501)), int(rng.integers(320, 376))
        width, height = (long, short) if rng.random() < 0.75 else (short, long)
        pixels = 128 + 0.8 * _octave(rng, height, width, 48, 3)
        for cell, amplitude in ((16, 0.5), (6, 0.35), (2, 0.22)):
            pixels = pixels + amplitude * _octave(rng, height, width, cell, 1)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        image.save(directory / f"{i:05d}.jpg", "JPEG", quality=quality)


def jpeg_files(count: int = JPEG_FILES, seed: int = 0, quality: int = JPEG_QUALITY,
               cache: Path = JPEG_CACHE) -> list[str]:
    """The paths of the generated JPEGs, made on the first call and reused afterwards.

    The files are written into a temporary directory that is renamed into place when complete,
    so a run that was interrupted, or two that start at once, never see half a set.

    Args:
        count: Number of files.
        seed: Seed of the generator.
        quality: JPEG quality.
        cache: Parent directory of the sets of files.

    Returns:
        Paths of the ``count`` files, in order.
    """
    final = cache / f"jpeg-v{JPEG_GENERATOR}-n{count}-s{seed}-q{quality}"
    if not final.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache))
        try:
            make_jpegs(tmp / "files", count, seed, quality)
            try:
                os.rename(tmp / "files", final)
            except OSError:
                if not final.is_dir():  # not another run's complete set: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    paths = sorted(str(p) for p in final.glob("*.jpg"))
    if len(paths) != count:
        raise RuntimeError(f"{final} holds {len(paths)} JPEGs, not {count}: delete it to regenerate")
    return paths


class JpegDataset(Dataset):
    """Map-style dataset whose item ``i`` is file ``i % len(paths)``, decoded and augmented per call.

    ``__getitem__`` reads the file's bytes, decodes them with PIL (which releases the GIL while
    it decodes), takes a random ``crop`` x ``crop`` crop and flips it horizontally with
    probability 1/2, drawing from torch's global RNG as torchvision's ``RandomCrop`` and
    ``RandomHorizontalFlip`` do, and returns a contiguous uint8 CHW tensor. Only paths are held,
    so the dataset pickles small under spawn.

    Args:
        length: Number of items the dataset reports.
        paths: The JPEG files (see :func:`jpeg_files`).
        crop: Side of the square crop; every image must be at least this large.
    """

    def __init__(self, length: int, paths: list[str], crop: int = JPEG_CROP):
        self.length, self.paths, self.crop = length, list(paths), crop

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        Image = _pil_image()
        with open(self.paths[index % len(self.paths)], "rb") as f:
            data = f.read()
        image = Image.open(io.BytesIO(data))
        image = image.convert("RGB")  # decodes (a no-op conversion for these RGB files)
        width, height = image.size
        top = int(torch.randint(0, height - self.crop + 1, size=(1,)).item())
        left = int(torch.randint(0, width - self.crop + 1, size=(1,)).item())
        image = image.crop((left, top, left + self.crop, top + self.crop))
        if torch.rand(1).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def jpeg(files: int = JPEG_FILES, seed: int = 0) -> Workload:
    """JPEGs on disk, decoded, randomly cropped to 224x224 and flipped, 64 per batch: CPU-bound decode.

    Makes the files on first use (a few seconds), so building this workload needs Pillow;
    importing this module does not.

    Args:
        files: Number of distinct JPEG files.
        seed: Seed of the files' generator.

    Returns:
        The jpeg workload.
    """
    paths = jpeg_files(files, seed)
    mean_kb = sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3
    return Workload(
        name="jpeg",
        make_dataset=partial(JpegDataset, paths=paths, crop=JPEG_CROP),
        loader_kwargs={"batch_size": BATCH_SIZE},
        unit="batch/s",
        describe={
            "files": files, "seed": seed, "quality": JPEG_QUALITY, "mean_file_kb": round(mean_kb, 1),
            "directory": str(Path(paths[0]).parent), "item_shape": [3, JPEG_CROP, JPEG_CROP],
            "dtype": "uint8", "batch_size": BATCH_SIZE, "decoder": "PIL",
        },
    )
