"""Auto-tuning of ``num_workers``, ``prefetch_factor`` and ``worker_type`` by measured throughput.

- ``search``: the search (pure: it proposes settings and reads their measurements);
- ``measure``: runs one setting for warm-up plus windows, with the user's step;
- ``offline``: ``fastfeed.tune()``, on fresh loaders;
- ``online``: ``DataLoader(num_workers="auto")``, tuned on the first epoch the user consumes;
- ``cache``: results keyed by dataset, loader and host, in a JSON file;
- ``agree``: every rank ends with the slowest rank's result under ``torch.distributed``;
- ``result``: ``TuneResult``, ``load_config``.
"""

from .result import Setting, Trial, TuneResult, load_config
from .offline import tune

__all__ = ["Setting", "Trial", "TuneResult", "load_config", "tune"]
