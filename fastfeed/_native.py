"""The compiled core, loaded once, with a message that says how to fix a bad build."""

try:
    from . import _C as C  # noqa: F401  (re-exported: fastfeed._native.C)
except ImportError as e:  # pragma: no cover - only a broken install gets here
    raise ImportError(
        "fastfeed's C++ extension (fastfeed._C) is missing or does not load: "
        f"{e}. Reinstall with `pip install --no-build-isolation -e .` from the source tree "
        "(it needs a C++17 compiler and pybind11)."
    ) from e
