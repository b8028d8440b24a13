"""Other libraries' shard loaders, set up as their own documentation recommends: webdataset and MosaicML Streaming.

``fastfeed bench shards`` runs them against ``fastfeed.io.Shards`` on the same samples and the same decode. Both are
benchmark-only dependencies: :func:`missing` says which ``pip install`` brings one that is absent, and the bench
skips that loader with that line.

- webdataset: ``WebDataset(urls, shardshuffle=<number of shards>, seed=...)`` (its default splitters:
  ``single_node_only``, ``split_by_worker``), ``.shuffle(SHUFFLE_BUFFER)``, ``.map(decode)``, ``.batched(B)`` with
  torch's ``default_collate`` in the workers, under torch's ``DataLoader(batch_size=None)``, as its README does. An
  ``http://`` URL is read by its ``curl`` pipe (webdataset's default for HTTP).
- Mosaic: a ``StreamingDataset`` subclass whose ``__getitem__`` decodes (its documented way to transform samples),
  under its ``StreamingDataLoader`` (which has ``state_dict``). Mosaic reads no HTTP URL (S3, GCS, OCI, Azure, HF,
  SFTP, local...), so its remote is ``s3://BUCKET/...`` at an endpoint given by ``S3_ENDPOINT_URL``, which
  :func:`s3_environment` sets for the duration of a run.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from multiprocessing import shared_memory
from typing import Any, Callable

from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import default_collate

SHUFFLE_BUFFER = 1000  # webdataset's sample shuffle buffer (its README's example uses 1000)
PIP = {"webdataset": "pip install webdataset", "mosaic": "pip install mosaicml-streaming"}


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(peer: str) -> str | None:
    """None when ``peer`` (``"webdataset"`` or ``"mosaic"``) can run here; else what is missing and its ``pip``.

    Mosaic is imported to know (a few seconds: it imports transformers): an install whose dependencies do not
    import (Pillow, say) is as absent as none.
    """
    module = {"webdataset": "webdataset", "mosaic": "streaming"}[peer]
    package = "webdataset" if peer == "webdataset" else "mosaicml-streaming"
    if not _found(module):
        return f"needs {package}, which is not installed: {PIP[peer]}"
    if peer == "mosaic":
        try:
            import_streaming()
        except Exception as e:  # any failure of its import chain
            return f"needs {package}, which does not import here ({type(e).__name__}: {e}): {PIP[peer]}"
    return None


# --- webdataset ---------------------------------------------------------------------------------------------------


def webdataset_loader(urls: list[str], decode: Callable[[dict], Any], *, batch_size: int, num_workers: int,
                      seed: int) -> TorchDataLoader:
    """webdataset's recommended pipeline over ``urls``, batched in the workers, under torch's DataLoader.

    Args:
        urls: The tar shards (paths or ``http://`` URLs).
        decode: Sample dict (``{"__key__", "jpg": bytes, "cls": bytes, ...}``) to what a batch collates.
        batch_size: Samples per batch (``.batched`` in the pipeline; the loader adds no batching).
        num_workers: torch DataLoader workers (``split_by_worker`` gives each its shards).
        seed: Seed of the shard shuffle and of the sample shuffle buffer.
    """
    import webdataset as wds

    ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False)
          .shuffle(SHUFFLE_BUFFER, seed=seed)
          .map(decode)
          .batched(batch_size, collation_fn=default_collate, partial=True))  # fmt: skip
    return TorchDataLoader(ds, batch_size=None, num_workers=num_workers)


# --- MosaicML Streaming -------------------------------------------------------------------------------------------

_PLACEHOLDER = "torchvision"


def _placeholder_torchvision() -> None:
    """Put a minimal ``torchvision`` in ``sys.modules``, only where the real one cannot be imported.

    Why: ``import streaming`` imports ``streaming.vision`` at top level, whose base module does
    ``from torchvision.datasets import VisionDataset`` and ``from torchvision.transforms.functional import
    to_tensor``. ``StreamingDataset`` itself never uses torchvision. A CPU-only torch often has no working
    torchvision (PyPI's wheel is built for CUDA torch: importing it fails with "operator torchvision::nms does not
    exist"), and Mosaic's streaming would then not import at all. The placeholder carries those two names, each of
    which raises if used, so only Mosaic's vision datasets (which this bench never uses) are unusable. Each module
    has a spec, so ``importlib.util.find_spec`` (transformers calls it at import) answers, and with no installed
    distribution transformers takes torchvision as absent.
    """
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # ImportError, or the RuntimeError of a torchvision built for another torch
        for name in [m for m in sys.modules if m == _PLACEHOLDER or m.startswith(_PLACEHOLDER + ".")]:
            del sys.modules[name]  # the half-imported real one

    def unusable(*args, **kwargs):
        raise ImportError("torchvision is not importable here: fastfeed's bench put a placeholder in its place so "
                          "that MosaicML Streaming imports; install a torchvision built for this torch to use it")

    class VisionDataset:
        def __init__(self, *args, **kwargs):
            unusable()

    modules = {name: types.ModuleType(name) for name in
               (_PLACEHOLDER, f"{_PLACEHOLDER}.datasets", f"{_PLACEHOLDER}.transforms",
                f"{_PLACEHOLDER}.transforms.functional")}  # fmt: skip
    for name, module in modules.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__fastfeed_placeholder__ = True
    modules[f"{_PLACEHOLDER}.datasets"].VisionDataset = VisionDataset
    modules[f"{_PLACEHOLDER}.transforms.functional"].to_tensor = unusable
    modules[_PLACEHOLDER].datasets = modules[f"{_PLACEHOLDER}.datasets"]
    modules[_PLACEHOLDER].transforms = modules[f"{_PLACEHOLDER}.transforms"]
    modules[f"{_PLACEHOLDER}.transforms"].functional = modules[f"{_PLACEHOLDER}.transforms.functional"]
    sys.modules.update(modules)


def import_streaming() -> types.ModuleType:
    """``import streaming`` (MosaicML Streaming), with :func:`_placeholder_torchvision` first."""
    if "streaming" not in sys.modules:
        _placeholder_torchvision()
    import streaming

    return streaming


SHM = "/dev/shm"


def mosaic_segments() -> set[str]:
    """Mosaic's segments in /dev/shm now: ``<6-digit prefix>_<one of its names>``."""
    names = tuple(f"_{n}" for n in import_streaming().base.constant.SHM_TO_CLEAN)
    try:
        return {n for n in os.listdir(SHM) if n[:6].isdigit() and n[6:] in names}
    except OSError:
        return set()


def clean_shared_memory(keep: set[str] | None = None) -> list[str]:
    """Remove what Mosaic's datasets left in ``/dev/shm``: its own cleaner first, then any of its segments not in
    ``keep`` (its cleaner stops at the first prefix number with nothing left, so one past a gap survives it).

    Call it with no Mosaic dataset alive: a live dataset's segments would be removed under it.

    Returns:
        The segments the second step removed.
    """
    import_streaming().base.util.clean_stale_shared_memory()
    removed = sorted(mosaic_segments() - (keep or set()))
    for name in removed:
        # Through SharedMemory, not os.unlink: its unlink() also tells multiprocessing's resource tracker, which
        # would otherwise warn at exit about each segment it can no longer find.
        with contextlib.suppress(FileNotFoundError):
            segment = shared_memory.SharedMemory(name=name)
            segment.close()
            segment.unlink()
    return removed



@contextlib.contextmanager
def s3_environment(endpoint: str):
    """``S3_ENDPOINT_URL`` (what Mosaic's S3 downloader reads) and placeholder credentials, restored after.

    boto3 signs every request and refuses to send one without credentials; the local endpoint ignores them.
    """
    values = {"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "fastfeed-bench",
              "AWS_SECRET_ACCESS_KEY": "fastfeed-bench", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_mds(samples, out: str, size_limit: int) -> list[str]:
    """Write ``samples`` (an iterable of ``{"jpg": bytes, "cls": int}``) as MDS shards in ``out``; their names."""
    streaming = import_streaming()
    with streaming.MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit=size_limit,
                             progress_bar=False) as writer:  # fmt: skip
        for sample in samples:
            writer.write(sample)
    return sorted(n for n in os.listdir(out) if n.endswith(".mds"))


def mosaic_loader(remote: str | None, local: str, decode: Callable[[dict], Any], *, batch_size: int,
                  num_workers: int, seed: int, cache_limit: int | None = None, predownload: int | None = None,
                  shuffle_block_size: int | None = None):
    """Mosaic's ``StreamingDataset`` (shuffled, its default ``py1e``) decoding in ``__getitem__``, under its
    ``StreamingDataLoader``.

    Args:
        remote: ``s3://bucket/prefix`` of the MDS shards, or None to read them in place at ``local``.
        local: Mosaic's local directory (its cache, or the shards themselves when ``remote`` is None); one per
            dataset alive at a time.
        decode: Sample dict (``{"jpg": bytes, "cls": int}``) to what a batch collates.
        batch_size: Samples per batch (given to both the dataset and the loader, as Mosaic asks).
        num_workers: DataLoader workers.
        seed: Mosaic's ``shuffle_seed``.
        cache_limit: Mosaic's ``cache_limit`` in bytes (it evicts the least recently used shards), or None.
        predownload: Samples each worker downloads ahead (None: Mosaic's default, ``8 * batch_size``).
        shuffle_block_size: Samples per shuffle block (None: Mosaic's default, at least 262,144).
    """
    streaming = import_streaming()

    class Decoded(streaming.StreamingDataset):
        def __getitem__(self, index: int) -> Any:
            return decode(super().__getitem__(index))

    ds = Decoded(remote=remote, local=local, shuffle=True, shuffle_seed=seed, batch_size=batch_size,
                 cache_limit=cache_limit, predownload=predownload, shuffle_block_size=shuffle_block_size)
    return streaming.StreamingDataLoader(ds, batch_size=batch_size, num_workers=num_workers)

