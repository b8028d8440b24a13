"""Runs a pytest-style test file where pytest is not installed, as on a bare GPU machine.

    python3 scripts/gpu_tests.py tests/test_gpu.py [-k SUBSTRING]

It provides the few pieces of pytest that tests/test_gpu.py uses, and no more: ``pytest.mark.parametrize``,
``pytest.mark.skipif`` (on a test or in a module's ``pytestmark``), ``pytest.skip``, ``pytest.raises`` and
``pytest.fail``; any other mark (``pytest.mark.fastfeed_only``) is accepted and ignored. Tests take no fixtures
but ``tmp_path``. It prints a line per test, each failure's traceback, and pytest's summary line
("3 passed, 1 skipped in 2.0s"); it exits 1 when a test failed or the file did not import, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path


class Skipped(Exception):
    """``pytest.skip(reason)``."""


class Failed(AssertionError):
    """``pytest.fail(reason)``."""


class Mark:
    """``pytest.mark.NAME(*args, **kwargs)``: a decorator that records itself on the test."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):  # applied to a test (as pytest does)
            fn = args[0]
            fn.pytestmark = [*getattr(fn, "pytestmark", []), self]
            return fn
        return Mark(self.name, args, kwargs)


class _Marks:
    def __getattr__(self, name: str) -> Mark:
        return Mark(name)


class _Raises:
    def __init__(self, expected, match: str | None):
        self.expected, self.match, self.value = expected, match, None

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            raise Failed(f"DID NOT RAISE {self.expected}")
        if not issubclass(kind, self.expected):
            return False
        if self.match is not None and not re.search(self.match, str(value)):
            raise Failed(f"the message {str(value)!r} does not match {self.match!r}")
        self.value = value
        return True


def _skip(reason: str = "") -> None:
    raise Skipped(reason)


def _fail(reason: str = "") -> None:
    raise Failed(reason)


def shim() -> types.ModuleType:
    """A module named pytest with the pieces this runner supports."""
    module = types.ModuleType("pytest")
    module.mark = _Marks()
    module.skip = _skip
    module.fail = _fail
    module.raises = lambda expected, *, match=None: _Raises(expected, match)
    return module


def marks(obj) -> list[Mark]:
    found = getattr(obj, "pytestmark", [])
    return list(found) if isinstance(found, (list, tuple)) else [found]


def cases(fn, module_marks: list[Mark]):
    """``(id, kwargs, skip reason or None)`` for each case of ``fn`` (its parametrize marks expanded)."""
    all_marks = module_marks + marks(fn)
    skip = next((m.kwargs.get("reason", "") or "skipif" for m in all_marks
                 if m.name == "skipif" and (m.args[0] if m.args else m.kwargs.get("condition"))), None)  # fmt: skip
    skip = skip or next((m.kwargs.get("reason", "") or "skip" for m in all_marks if m.name == "skip"), None)
    axes = []
    for m in marks(fn):  # nearest the function first: first in the id, and slowest to vary, as in pytest
        if m.name != "parametrize":
            continue
        names = m.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        values = [v if len(names) > 1 else (v,) for v in m.args[1]]
        axes.append([(dict(zip(names, v)), "-".join(str(x) for x in v)) for v in values])
    for combo in itertools.product(*axes) if axes else [()]:
        kwargs, ids = {}, []
        for params, ident in combo:
            kwargs.update(params)
            ids.append(ident)
        yield (f"{fn.__name__}[{'-'.join(ids)}]" if ids else fn.__name__), kwargs, skip


def run_case(fn, kwargs: dict) -> None:
    wanted = inspect.signature(fn).parameters
    missing = [name for name in wanted if name not in kwargs and name != "tmp_path"]
    if missing:
        raise Failed(f"needs fixture(s) {', '.join(missing)}, which scripts/gpu_tests.py does not provide")
    with contextlib.ExitStack() as stack:
        if "tmp_path" in wanted:
            tmp = tempfile.mkdtemp(prefix="gpu-tests-")
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
            kwargs = dict(kwargs, tmp_path=Path(tmp))
        fn(**kwargs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="the test file")
    parser.add_argument("-k", dest="keyword", help="run only tests whose id contains this")
    args = parser.parse_args(argv)
    path = Path(args.path).resolve()
    sys.path.insert(0, str(path.parent))  # the tests' helper modules, as pytest's rootdir import gives them
    sys.modules.setdefault("pytest", shim())
    t0 = time.perf_counter()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # what pickles its datasets by reference
        spec.loader.exec_module(module)
    except Exception:
        traceback.print_exc()
        print(f"ERROR collecting {args.path}\n1 error in {time.perf_counter() - t0:.1f}s")
        return 1
    module_marks = marks(module)
    tests = [fn for name, fn in vars(module).items() if name.startswith("test_") and inspect.isfunction(fn)]
    for fn in tests:
        for ident, kwargs, skip in cases(fn, module_marks):
            if args.keyword and args.keyword not in ident:
                continue
            started = time.perf_counter()
            if skip is not None:
                outcome, detail = "skipped", skip
            else:
                try:
                    run_case(fn, kwargs)
                    outcome, detail = "passed", ""
                except Skipped as e:
                    outcome, detail = "skipped", str(e)
                except Exception:
                    outcome, detail = "failed", traceback.format_exc()
            counts[outcome] += 1
            took = time.perf_counter() - started
            why = f": {detail}" if outcome == "skipped" else ""
            print(f"{outcome.upper():<8} {path.name}::{ident} ({took:.1f}s){why}", flush=True)
            if outcome == "failed":
                print(detail, flush=True)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no tests ran"
    print(f"{summary} in {time.perf_counter() - t0:.1f}s", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
