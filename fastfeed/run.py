"""``fastfeed run SCRIPT [ARGS...]`` (or ``-m MODULE``): the script as ``python`` runs it, with every
``torch.utils.data.DataLoader`` it builds replaced by ``fastfeed.DataLoader`` (``fastfeed.replace``).

The script runs in this process as ``__main__``, with its ``argv`` and ``sys.path[0]``. Processes it starts
anew (spawn, forkserver) inherit the replacement through ``FASTFEED_RUN=1`` and a ``sitecustomize`` on
``PYTHONPATH``; forked ones inherit the patch itself. At exit one line says how many loaders were replaced and
where they were made. ``FASTFEED_RUN_EXCLUDE=module.Class,...`` opts classes out.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import replace

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_run_site")
_child = None


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a script with every torch DataLoader it builds replaced by fastfeed's",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name, as python -m")
    p.add_argument("script", help="the script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(run=main)


def install_in_child() -> None:
    """In a process started anew under ``fastfeed run``: replace loaders there too (no summary of its own)."""
    global _child
    if _child is None:
        _child = replace.Replacer().install()


def main(args) -> int:
    if not args.module and not os.path.isfile(args.script):
        print(f"fastfeed run: no script at {args.script!r} (give a path, or -m for a module)", file=sys.stderr)
        return 2
    saved_argv, saved_path = sys.argv, list(sys.path)
    saved_env = {k: os.environ.get(k) for k in ("FASTFEED_RUN", "PYTHONPATH")}
    os.environ["FASTFEED_RUN"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")]))
    sys.argv = [args.script, *args.args]
    if not args.module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    replacer = replace.Replacer().install()
    code = 0
    try:
        if args.module:
            runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    finally:
        replacer.close()
        sys.argv, sys.path[:] = saved_argv, saved_path
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        print(replacer.summary(), file=sys.stderr)
    return code
