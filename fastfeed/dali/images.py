"""``image_classification``: the standard ImageNet-style input pipeline in DALI, as a ``DALILoader``.

Training: files shuffled, decoded straight into a random area (8-100%) and aspect ratio (3/4-4/3)
crop, resized to ``crop`` x ``crop``, flipped with probability 1/2 (torchvision's
``RandomResizedCrop`` + ``RandomHorizontalFlip``). Evaluation: the shorter side resized to
``crop / 0.875`` (256 for 224), centre crop. Both end in ``crop_mirror_normalize``: float32
normalised by ``mean`` / ``std`` (as fractions of 255, torchvision's convention), or uint8 left as
decoded (normalise on the GPU, where the bytes are 4x fewer). Decoding is "mixed" (nvJPEG) on
the GPU and libjpeg-turbo on the CPU.
"""

from __future__ import annotations

import os

import torch
from nvidia.dali import fn, pipeline_def, types

from . import folders
from .loader import DALILoader

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_RATIO = 0.875  # crop / resized shorter side: 224 / 256
LAYOUTS = {"NCHW": "CHW", "NHWC": "HWC"}
DTYPES = {torch.float32: types.FLOAT, torch.uint8: types.UINT8}


@pipeline_def
def classification_pipeline(files, labels, train, crop, mean, std, layout, dtype, decode_device,
                            shard_id=0, num_shards=1, pad_last_batch=True):  # fmt: skip
    jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=train, shard_id=shard_id,
                                   num_shards=num_shards, pad_last_batch=pad_last_batch, name="Reader")  # fmt: skip
    if train:
        images = fn.decoders.image_random_crop(jpegs, device=decode_device, output_type=types.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])  # fmt: skip
        images = fn.resize(images, resize_x=crop, resize_y=crop)
        mirror = fn.random.coin_flip(probability=0.5)
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB)
        images = fn.resize(images, resize_shorter=round(crop / EVAL_RATIO))
        mirror = 0
    images = fn.crop_mirror_normalize(images, dtype=dtype, output_layout=layout, crop=(crop, crop), mean=mean,
                                      std=std, mirror=mirror)  # fmt: skip
    # ImageFolder's targets collate to int64 of shape (batch,)
    return images, fn.cast(fn.reshape(label, shape=[]), dtype=types.INT64)


def image_classification(root_or_file_list, *, batch_size: int, crop: int = 224, mean=IMAGENET_MEAN,
                         std=IMAGENET_STD, train: bool = True, device: str = "cpu", seed: int | None = None,
                         layout: str = "NCHW", dtype: torch.dtype = torch.float32, on_corrupt: str = "raise",
                         **loader_kwargs) -> DALILoader:  # fmt: skip
    """A ``DALILoader`` of ``(images, labels)`` batches for image classification.

    Args:
        root_or_file_list: a folder with a subfolder per class (``ImageFolder``'s layout; labels
            are ImageFolder's class indices), or DALI's file list (``relative/path label`` lines).
        batch_size: samples per batch.
        crop: the side of the square images.
        mean, std: per channel, as fractions of 255 (torchvision's ``Normalize`` values); used
            only with ``dtype=torch.float32``.
        train: random resized crop, flip and shuffling; False: resize and centre crop, in order.
        device: ``"cpu"`` (libjpeg-turbo, CPU tensors) or ``"gpu"`` (nvJPEG, tensors on this
            rank's GPU: ``LOCAL_RANK``, else the current device).
        seed: DALI's seed; None draws one from torch's generator.
        layout: ``"NCHW"`` (torch's convention) or ``"NHWC"``.
        dtype: ``torch.float32`` (normalised) or ``torch.uint8`` (as decoded, cropped and flipped).
        on_corrupt: a file that cannot be read or decoded is an error naming it (``"raise"``), or
            is left out with a warning naming it (``"skip"``). Checked when the loader is made.
        **loader_kwargs: ``DALILoader``'s (``last_batch``, ``numa``, ``auto_shard``) and the
            pipeline's (``num_threads``, ``prefetch_queue_depth``).
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if device == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("image_classification(device='gpu') decodes with nvJPEG on a CUDA GPU, and CUDA is not "
                           f"available here (torch {torch.__version__}); use device='cpu'")  # fmt: skip
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be torch.float32 or torch.uint8, got {dtype!r}")
    if isinstance(crop, bool) or not isinstance(crop, int) or crop <= 0:
        raise ValueError(f"crop must be a positive int, got {crop!r}")
    paths, labels = _listed(root_or_file_list)
    paths, labels = folders.checked(paths, labels, on_corrupt)
    if dtype == torch.uint8:
        mean, std = (0.0,), (1.0,)
    else:
        mean, std = [m * 255 for m in _channels("mean", mean)], [s * 255 for s in _channels("std", std)]
    target = None
    if device == "gpu":
        local = os.environ.get("LOCAL_RANK")
        target = torch.device("cuda", int(local) if local else torch.cuda.current_device())
    return DALILoader(classification_pipeline, ("images", "labels"), batch_size=batch_size, seed=seed, device=target,
                      files=paths, labels=labels, train=train, crop=crop, mean=mean, std=std,
                      layout=LAYOUTS[layout], dtype=DTYPES[dtype], decode_device="mixed" if target else "cpu",
                      **loader_kwargs)  # fmt: skip


def _listed(source) -> tuple[list[str], list[int]]:
    source = os.fspath(source)
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source} does not exist: pass an ImageFolder-style folder or a file list")
    if os.path.isdir(source):
        paths, labels, _ = folders.image_folder(source)
        return paths, labels
    return folders.file_list(source)


def _channels(name: str, values) -> list[float]:
    values = [float(v) for v in values]
    if len(values) not in (1, 3):
        raise ValueError(f"{name} must have 1 or 3 values (one per channel), got {values}")
    return values
