"""fastfeed: keep GPUs fed. ``from fastfeed import DataLoader`` and change nothing else."""

from torch.utils.data import get_worker_info

from . import transforms
from ._ring.ring import RingGrowthWarning
from .loader import DataLoader

__version__ = "0.1.0"

__all__ = ["DataLoader", "RingGrowthWarning", "__version__", "get_worker_info", "transforms"]
