"""Put on PYTHONPATH by ``fastfeed run`` so that processes it starts anew (spawn, forkserver, subprocesses of
Python) build fastfeed's loaders too. It installs the replacement when ``FASTFEED_RUN`` is set, then runs the
``sitecustomize`` this one shadows, if the environment has one."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("FASTFEED_RUN") == "1":
    try:
        from fastfeed import run as _run

        _run.install_in_child()
    except Exception as e:  # never stop the child from starting
        print(f"fastfeed run: could not replace DataLoaders in process {os.getpid()}: {e}", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
