"""What a new user's first run looks like, for the tests of it: a plain install, and output without targets.

``BASE_INSTALL`` is a ``sitecustomize`` that makes this interpreter (and every Python process it starts) look like
``pip install fastfeed`` without extras: a meta-path finder refuses the optional packages, and
``importlib.util.find_spec`` answers None for them, as it does where they are not installed.
"""

import re

OPTIONAL = ("aiohttp", "matplotlib", "pynvml", "PIL", "nvidia.dali", "accelerate", "ray")

BASE_INSTALL = f'''
import importlib.abc, importlib.machinery, importlib.util, os, sys

OPTIONAL = {OPTIONAL!r}


def _refused(name):
    return any(name == m or name.startswith(m + ".") for m in OPTIONAL)


class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _refused(name):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Refuse())
_find_spec = importlib.util.find_spec


def _absent_find_spec(name, package=None):
    if _refused(importlib.util.resolve_name(name, package)):
        return None
    return _find_spec(name, package)


importlib.util.find_spec = _absent_find_spec

# then the sitecustomize this one shadows, if the environment has one
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
'''

# A development target in what users see: a bar with its comparison ("bar >=6.0x", "bar: <= 1.0x", "bars >= ...")
# or a pass/miss word ("MISSED", "missed", "MISS", "FAIL", "PASS", "meets_bar").
TARGET = re.compile(r"\bbars?\b *:? *[<>]=?|\bMISS(ED)?\b|\bmissed\b|\bFAIL(ED)?\b|\bPASS(ED)?\b|meets_bar")
