"""Helpers for the DALI tests: small generated JPEG folders, and a fake of the CUDA calls pinned staging makes."""

import collections
import os

import numpy as np
import torch

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


class FakeCopyEvent:
    def __init__(self, dst, src):
        self.dst, self.src, self.complete = dst, src, False


class FakeCuda:
    """Stands in for fastfeed.dali.staging's CUDA calls: a copy reads its pinned source only when its event
    completes (when the test says, or when staging waits for it), as a DMA queued behind kernels would."""

    def __init__(self):
        self.pinned_buffers = []
        self.pending = collections.deque()  # events not complete yet, in stream order
        self.waits = 0

    def pinned(self, nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_buffers.append(buf)
        return buf

    def copy(self, host, device):
        base = host.untyped_storage().data_ptr()
        assert any(b.untyped_storage().data_ptr() == base for b in self.pinned_buffers), "copy from unpinned memory"
        dst = torch.zeros_like(host)
        event = FakeCopyEvent(dst, host)
        self.pending.append(event)
        return dst, event

    def done(self, event):
        return event.complete

    def wait(self, event):
        self.waits += 1
        self.complete(event)

    def complete(self, event=None):
        """Run the queued copies in order, up to ``event`` (None: all of them)."""
        while self.pending and (event is None or not event.complete):
            first = self.pending.popleft()
            first.dst.copy_(first.src)
            first.src, first.complete = None, True
