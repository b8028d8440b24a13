"""Sphinx configuration of fastfeed's documentation site: Markdown pages (MyST), furo, and an API reference
generated from the docstrings (autodoc + napoleon). Build: ``python -m sphinx -W --keep-going -b html docs OUT``."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(REPO))  # document this checkout's fastfeed

project = "fastfeed"
author = "fastfeed contributors"
copyright = "fastfeed contributors"

from fastfeed import __version__ as release  # noqa: E402

version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "bench_tables",  # docs/_ext/bench_tables.py: the benchmark tables, printed from docs/bench/*.json at build time
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "requirements.txt"]

myst_heading_anchors = 3  # links such as guide/loader.md#pinned-memory resolve, and a wrong one fails -W
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"fastfeed {release}"
html_static_path = []
smartquotes = False  # keep "process" and the like as typed, in tables too
napoleon_use_param = False  # one "Parameters" list; it also keeps "*args, **kwargs" entries intact

# A reference to a fastfeed name that the API reference does not document fails the build (so a renamed or removed
# API cannot linger in the pages); references to other libraries' names (torch, numpy...) are not checked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!fastfeed\.).*")]
# Internal types that public signatures name (documented where they are used, not as API of their own).
nitpick_ignore = [("py:obj", "fastfeed.loader._T_co"), ("py:class", "fastfeed.doctor.timeline.Timeline"),
                  ("py:class", "fastfeed.doctor.ranks.RankRecord"), ("py:class", "fastfeed.doctor.ranks.RankSplit"),
                  ("py:class", "fastfeed.io.arrays.Range")]
