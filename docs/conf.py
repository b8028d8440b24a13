"""Sphinx configuration of fastfeed's documentation site: Markdown pages (MyST), furo, and an API reference
generated from the docstrings (autodoc + napoleon). Build: ``bash scripts/docs.sh`` (set-up, then
``.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html``)."""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(REPO))  # document this checkout's fastfeed

project = "fastfeed"
author = "fastfeed contributors"
copyright = "fastfeed contributors"

# The API reference is made from fastfeed's docstrings, so the build imports fastfeed, and with it torch and the C++
# extension built from csrc/. Without them Sphinx would only say "programmable error in your configuration file";
# name the one command that installs them instead.
try:
    from fastfeed import __version__ as release  # noqa: E402
except ImportError as err:
    from sphinx.errors import ConfigError

    raise ConfigError(
        f"the docs build imports fastfeed, and here it cannot: {err}.\n"
        "Build the site with `bash scripts/docs.sh` (it runs scripts/setup.sh, which creates .venv with torch, "
        "fastfeed and docs/requirements.txt, then Sphinx in .venv), or run Sphinx with .venv/bin/python."
    ) from err

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
html_static_path = ["_static"]
html_css_files = ["wrap.css"]  # code blocks wrap instead of scrolling sideways (see the file)
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
