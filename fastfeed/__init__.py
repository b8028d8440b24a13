"""fastfeed: keep GPUs fed. ``from fastfeed import DataLoader`` and change nothing else."""

from torch.utils.data import get_worker_info

from . import doctor, io, transforms
from ._ring.ring import RingGrowthWarning
from .loader import DataLoader
from .stateful import StatefulDataLoader
from .stats import Stats
from .tuning import TuneResult, load_config, tune

__version__ = "0.1.0"

__all__ = [
    "DataLoader", "RingGrowthWarning", "StatefulDataLoader", "Stats", "TuneResult", "__version__", "doctor",
    "get_worker_info", "io", "load_config", "transforms", "tune",
]  # fmt: skip
