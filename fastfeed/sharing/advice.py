"""The loader's one-time warning: a dataset whose Python containers every worker will copy as it reads them."""

from __future__ import annotations

import warnings

from .find import large_containers

WARN_BYTES = 64 << 20  # below this, the copies cost less than unpickling every item on every access would
_warned: set = set()  # (dataset type, attribute): once per process, however many loaders or epochs


class CopyOnReadWarning(UserWarning):
    """A dataset holds a large Python container that each worker process will copy (pytorch/pytorch#13246)."""


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def warn_if_copied(dataset, num_workers: int, stacklevel: int = 2) -> None:
    """Warn, once per dataset type and attribute, when ``num_workers`` processes will each copy a large container.

    Cheap (it samples; see find.py), and never fails the loader: a dataset whose attributes cannot be walked is
    simply not judged.
    """
    if num_workers <= 0:
        return
    try:
        found = large_containers(dataset, WARN_BYTES)
    except Exception:  # a dataset's own properties may raise when poked; the warning is advice, not a check
        return
    if not found:
        return
    big = found[0]
    key = (type(dataset).__qualname__, big.name)
    if key in _warned:
        return
    _warned.add(key)
    name = f"attribute '{big.name}'" if big.name else "itself"
    warnings.warn(
        f"fastfeed: the dataset's {name} is a {big.kind} of {big.count:,} Python objects (about {_mb(big.est_bytes)}"
        f"). Each of the {num_workers} worker processes will copy it as it reads it (reading a Python object "
        f"writes its reference count), up to about {_mb(big.est_bytes * num_workers)} in all, per rank. "
        "Hold it once per machine in shared memory with dataset = fastfeed.share(dataset) "
        "(see the fastfeed guide, 'Memory: one copy of the metadata').",
        CopyOnReadWarning,
        stacklevel=stacklevel + 1,
    )
