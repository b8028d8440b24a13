"""Image files and their labels, found as ``torchvision.datasets.ImageFolder`` finds them, and checked.

The class of a file is the index of its top-level folder in sorted order, as ImageFolder
numbers them, so a model trained through DALI keeps ImageFolder's label space. DALI stops the
whole pipeline on a file it cannot decode without naming it, so files are checked here first
(cheaply: readable, and a JPEG's markers up to the image data and its end marker, a PNG's
signature and end chunk); a bad file is an error naming it, or skipped with a warning.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
ON_CORRUPT = ("raise", "skip")
TAIL = 4096  # bytes searched for the end marker (some writers pad after it)
CHECK_THREADS = 16  # the checks wait on storage, not on the CPU


class CorruptImageError(ValueError):
    """An image file that cannot be read or decoded."""


def image_folder(root: str) -> tuple[list[str], list[int], list[str]]:
    """``(paths, labels, classes)`` as ImageFolder lists them (same order, same class indices).

    Raises:
        FileNotFoundError: no class folder, or a class without image files (ImageFolder's messages).
        PermissionError: a folder cannot be listed.
    """
    try:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    except NotADirectoryError:
        raise NotADirectoryError(f"{root} is not a directory: pass a folder with a subfolder per class "
                                 "(ImageFolder's layout) or a file list") from None  # fmt: skip
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    paths, labels, empty = [], [], []
    for index, name in enumerate(classes):
        before = len(paths)
        for folder, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True, onerror=_raise)):
            for fname in sorted(names):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(folder, fname))
                    labels.append(index)
        if len(paths) == before:
            empty.append(name)
    if empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(sorted(empty))}. "
                                f"Supported extensions are: {', '.join(IMG_EXTENSIONS)}")  # fmt: skip
    return paths, labels, classes


def _raise(error: OSError) -> None:
    raise error


def file_list(path: str) -> tuple[list[str], list[int]]:
    """DALI's file-list format: a line ``relative/path label`` per file, relative to the list's folder."""
    base = os.path.dirname(os.path.abspath(path))
    paths, labels = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            name, _, label = line.rstrip("\n").rpartition(" ")
            try:
                labels.append(int(label))
            except ValueError:
                raise ValueError(f"{path}:{number}: expected 'relative/path label', got {line.strip()!r}") from None
            paths.append(os.path.join(base, name))
    if not paths:
        raise ValueError(f"{path} lists no files")
    return paths, labels


def problem(path: str) -> str | None:
    """Why ``path`` cannot be an image, or None when it looks whole."""
    try:
        with open(path, "rb") as f:
            head = f.read(TAIL)
            size = os.fstat(f.fileno()).st_size
            tail = head[-TAIL:] if size <= TAIL else _tail(f, size)
            if not head:
                return "empty file"
            if head[:2] == b"\xff\xd8":
                return _jpeg_problem(f, size, tail)
            if head[:8] == b"\x89PNG\r\n\x1a\n":
                return None if b"IEND" in tail[-32:] else "truncated PNG (no IEND chunk)"
            if path.lower().endswith((".jpg", ".jpeg")):
                return "not a JPEG (no start-of-image marker)"
            if path.lower().endswith(".png"):
                return "not a PNG (bad signature)"
            return None
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def _tail(f, size: int) -> bytes:
    f.seek(size - TAIL)
    return f.read(TAIL)


def _jpeg_problem(f, size: int, tail: bytes) -> str | None:
    """Walk the marker segments from SOI to the start of scan; then look for the end-of-image marker."""
    pos = 2
    while True:
        if pos + 4 > size:
            return "truncated JPEG (it ends inside its headers)"
        f.seek(pos)
        marker = f.read(4)
        if len(marker) < 4 or marker[0] != 0xFF:
            return f"corrupt JPEG (bad marker at byte {pos})"
        kind = marker[1]
        if kind == 0xDA:  # start of scan: entropy-coded data follows
            break
        if kind in (0xD8, 0xD9) or 0xD0 <= kind <= 0xD7:
            return f"corrupt JPEG (unexpected marker 0x{kind:02X} at byte {pos})"
        pos += 2 + int.from_bytes(marker[2:4], "big")
    if b"\xff\xd9" not in tail:
        return "truncated JPEG (no end-of-image marker)"
    return None


def checked(paths: list[str], labels: list[int], on_corrupt: str) -> tuple[list[str], list[int]]:
    """``paths`` and ``labels`` without bad files (``on_corrupt="skip"``, with a warning naming them).

    Raises:
        CorruptImageError: ``on_corrupt="raise"`` and a file is bad; the message names it.
    """
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
    with ThreadPoolExecutor(min(CHECK_THREADS, max(1, len(paths)))) as pool:
        problems = list(pool.map(problem, paths, chunksize=64))
    bad = [(p, why) for p, why in zip(paths, problems) if why]
    if not bad:
        return paths, labels
    listed = "; ".join(f"{p}: {why}" for p, why in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    if on_corrupt == "raise":
        raise CorruptImageError(f"{len(bad)} of {len(paths)} image files cannot be decoded: {listed}. Fix or remove "
                                "them, or pass on_corrupt='skip' to leave them out")  # fmt: skip
    warnings.warn(f"skipping {len(bad)} of {len(paths)} image files that cannot be decoded (on_corrupt='skip'): "
                  f"{listed}", RuntimeWarning, stacklevel=3)  # fmt: skip
    keep = [i for i, why in enumerate(problems) if not why]
    if not keep:
        raise CorruptImageError(f"none of the {len(paths)} image files can be decoded: {listed}")
    return [paths[i] for i in keep], [labels[i] for i in keep]
