"""Helpers for the DALI tests: small generated JPEG folders and a pipeline over them."""

import os

import numpy as np

CLASSES = ("cat", "dog", "zebra")
PER_CLASS = 7  # 21 files: no batch size used in the tests divides it


def make_folder(root, classes=CLASSES, per_class=PER_CLASS, size=(24, 32)):
    """An ImageFolder-style tree of small JPEGs; the pixel values encode (class, index) for checks."""
    from PIL import Image

    for c, name in enumerate(classes):
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(per_class):
            pixels = np.full((*size, 3), 10 * c + i, dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"{i}.jpg"), quality=95)
    return str(root)


def files_and_labels(root):
    from fastfeed.dali import folders

    paths, labels, _ = folders.image_folder(root)
    return paths, labels


def ids(batch):
    """The (class, index) encoded in each image of a batch of (images, labels)."""
    images = batch[0] if isinstance(batch, tuple) else batch["images"]
    return [int(round(float(x.float().mean()))) for x in images]
