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
import sys

from . import _script, replace

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
    try:
        _script.check(args.script, args.module, "fastfeed run")
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    saved_env = {k: os.environ.get(k) for k in ("FASTFEED_RUN", "PYTHONPATH")}
    os.environ["FASTFEED_RUN"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")]))
    replacer = replace.Replacer().install()
    code = 0
    try:
        _script.run_as_main(args.script, args.args, args.module)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    finally:
        replacer.close()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        print(replacer.summary(), file=sys.stderr)
    return code
