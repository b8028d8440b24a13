"""fastfeed: keep GPUs fed. ``from fastfeed import DataLoader`` and change nothing else."""

from torch.utils.data import get_worker_info

from . import doctor, io, transforms
from ._ring.ring import RingGrowthWarning
from .loader import DataLoader
from .sharing import share
from ._version import __version__
from .stateful import StatefulDataLoader
from .stats import Stats
from .tuning import TuneResult, load_config, offline, tune

from . import accelerate  # noqa: E402  (registers its watcher on the loader's hook: it depends on the loader)

offline.use_loader(DataLoader)  # what fastfeed.tune() measures: tuning/ never imports the loader
del offline


__all__ = [
    "DataLoader", "RingGrowthWarning", "StatefulDataLoader", "Stats", "TuneResult", "__version__", "doctor",
    "get_worker_info", "io", "load_config", "share", "transforms", "tune",
]  # fmt: skip
