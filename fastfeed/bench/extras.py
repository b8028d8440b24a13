"""What the standard workloads need beyond the base install, and the line that says so when it is missing.

``pip install fastfeed`` runs every standard workload but two parts: jpeg decodes with Pillow, and the files
workload's HTTP part serves and reads its files with aiohttp and fsspec. Where they are missing, that part is
skipped with one line naming the extra that brings it, and the rest of the run and its report go on.
"""

from __future__ import annotations

import importlib.util

# module -> (the package's name, the extra of fastfeed that installs it)
MODULES = {"PIL": ("Pillow", "bench"), "fsspec": ("fsspec", "remote"), "aiohttp": ("aiohttp", "remote"),
           "ray": ("ray", "ray")}
WORKLOADS = {"jpeg": ("PIL",), "ray": ("ray",)}  # a standard workload -> the modules it cannot run without
HTTP = ("fsspec", "aiohttp")  # the files workload's HTTP part


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import, or a module without a spec
        return False


def missing(modules) -> str | None:
    """None when every one of ``modules`` is installed; else what is missing and the ``pip install`` that brings it.

    Returns:
        e.g. ``"needs Pillow, which is not installed: pip install 'fastfeed[bench]'"``.
    """
    absent = [m for m in modules if not installed(m)]
    if not absent:
        return None
    names = " and ".join(MODULES[m][0] for m in absent)
    extras = ",".join(dict.fromkeys(MODULES[m][1] for m in absent))
    verb = "is" if len(absent) == 1 else "are"
    return f"needs {names}, which {verb} not installed: pip install 'fastfeed[{extras}]'"


def missing_for(workload: str) -> str | None:
    """:func:`missing` for a standard workload (None for one that runs on the base install)."""
    return missing(WORKLOADS.get(workload, ()))
