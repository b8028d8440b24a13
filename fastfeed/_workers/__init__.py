"""The loader's workers: processes (``pool``) or threads (``threads``), both running ``loop``."""

WORKER_TYPES = ("process", "thread")  # DataLoader(worker_type=...); fastfeed.tune(worker_types=...) chooses among them
