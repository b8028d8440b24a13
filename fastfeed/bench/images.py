"""The jpeg workload's data: generated JPEGs on disk, decoded with PIL per sample, and the same through DALI.

Pillow and DALI are optional (``pip install 'fastfeed[bench]'`` brings Pillow, ``'fastfeed[dali]'`` DALI):
importing this module needs neither; making the files or decoding one needs Pillow.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import config

# The files: made once, then reused by every run (in fastfeed's cache directory).
JPEG_CACHE = Path(config.cache_dir()) / "bench"
JPEG_FILES = 512
JPEG_QUALITY = 90
JPEG_CROP = 224
JPEG_GENERATOR = 1  # bump when make_jpegs changes what it writes: the cache directory is named after it


def _pil_image():
    """PIL's ``Image`` module, imported on first use: Pillow is a benchmark dependency only."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("the jpeg workload needs Pillow: pip install 'fastfeed[bench]'") from exc
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



# --- jpeg through DALI: the same files, crop and flip, in fastfeed.dali's DALILoader ----------


def _dali_jpeg_pipeline():
    """The DALI pipeline of the jpeg workload, defined on first use: DALI is a benchmark option only.

    The same crop and flip as :class:`JpegDataset`, decoded more cleverly: ``fn.decoders.image_crop``
    decodes only the crop's region where the format allows (libjpeg-turbo's ROI decoding on the CPU,
    nvJPEG's with the ``"mixed"`` decoder), where PIL decodes the whole image and then crops it. On
    the CPU the pixels are PIL's: a crop at the same corner is bit-identical (tests/test_benchmarks.py
    checks it). ``crop_pos_x`` and ``crop_pos_y`` uniform on [0, 1] put the corner at
    ``round(pos * (size - crop))``, uniform over the valid corners as ``torch.randint(0, size - crop
    + 1)`` is, except that rounding makes the first and last corner half as likely. The flip is a coin
    of p=0.5; ``crop_mirror_normalize`` with ``dtype=UINT8`` and no mean or std only flips and
    transposes HWC to CHW.
    """
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def
    def jpeg_pipeline(files, crop, decoder, shard_id=0, num_shards=1, pad_last_batch=True):
        jpegs, _ = fn.readers.file(files=files, name="Reader", random_shuffle=False, shard_id=shard_id,
                                   num_shards=num_shards, pad_last_batch=pad_last_batch)  # fmt: skip
        images = fn.decoders.image_crop(jpegs, device=decoder, output_type=types.RGB, crop=(crop, crop),
                                        crop_pos_x=fn.random.uniform(range=[0.0, 1.0]),
                                        crop_pos_y=fn.random.uniform(range=[0.0, 1.0]))  # fmt: skip
        mirror = fn.random.coin_flip(probability=0.5)
        return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=mirror)

    return jpeg_pipeline


def dali_jpeg_loader(dataset: JpegDataset, *, batch_size: int, num_workers: int, device: str | None = None,
                     multiprocessing_context: Any = None) -> Any:
    """The jpeg workload's ``dataset`` as a ``fastfeed.dali.DALILoader``: DALI's threads decode, crop and flip.

    The loader reads the dataset's items, file ``i % len(paths)`` for item ``i``, in order, as
    torch's sequential sampler reads them: the reader does not shuffle (its shuffle buffer would
    also hold ~1,024 encoded files, ~58 MB, that the other sides do not). One epoch is
    ``len(dataset)`` items, so a trial's single iterator never reaches an epoch's end. Batches are
    1-tuples ``(images,)``, uint8 ``(batch_size, 3, 224, 224)`` as the torch side's.

    Args:
        dataset: A :class:`JpegDataset` (its paths, length and crop are used, not its ``__getitem__``).
        batch_size: Images per batch.
        num_workers: DALI's ``num_threads``: the same CPU budget as that many worker processes.
        device: None or ``"cpu"``: decoded on the CPU (libjpeg-turbo), batches on the CPU; ``"cuda:N"``:
            decoded with nvJPEG (DALI's ``"mixed"`` decoder) on GPU N, batches there.
        multiprocessing_context: Unused (DALI's workers are threads); taken so the runner's kwargs fit.

    Returns:
        The loader (its pipeline is built on the first ``iter`` or ``len``).
    """
    from fastfeed.dali import DALILoader

    gpu = device is not None and str(device).startswith("cuda")
    files = [dataset.paths[i % len(dataset.paths)] for i in range(len(dataset))]
    return DALILoader(_dali_jpeg_pipeline(), ("images",), batch_size=batch_size, num_threads=num_workers,
                      prefetch_queue_depth=2, device=device, files=files, crop=dataset.crop,
                      decoder="mixed" if gpu else "cpu")  # fmt: skip
