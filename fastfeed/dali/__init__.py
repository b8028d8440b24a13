"""NVIDIA DALI behind fastfeed: DALI pipelines with torch's DataLoader manners.

- ``DALILoader``: a DALI pipeline (or a ``@pipeline_def`` function fastfeed builds) as a loader:
  exact ``len``, epochs by iterating again, ``state_dict`` resume through DALI's checkpointing,
  sharding from ``torch.distributed`` or torchrun, NUMA placement of DALI's threads, and the
  same stats as ``fastfeed.DataLoader`` (so the doctor and the tuner read it);
- ``image_classification``: a ready decode / crop / flip / normalize pipeline over an
  ImageFolder-style directory, with ImageFolder's class indices;
- ``tune``: ``num_threads`` and ``prefetch_queue_depth`` by the tuner's search.

Needs ``pip install 'fastfeed[dali]'`` (NVIDIA DALI). Without it, importing this module says so.
"""

try:
    import nvidia.dali  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "fastfeed.dali needs NVIDIA DALI, which is not installed: pip install 'fastfeed[dali]' "
        f"(it installs nvidia-dali-cuda120; CPU-only pipelines run without a GPU). ({e})"
    ) from e

from .images import image_classification
from .loader import DALILoader
from .tuning import tune

__all__ = ["DALILoader", "image_classification", "tune"]
