#!/usr/bin/env bash
# Builds the documentation site into docs/_build/html, from a fresh clone as from a working one.
# The API reference is made from fastfeed's docstrings, so Sphinx must import fastfeed, torch and the C++ extension:
# scripts/setup.sh creates .venv with them and with docs/requirements.txt (and does nothing more once they are there),
# then Sphinx runs in .venv with warnings as errors, the build tests/test_docs.py runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html
echo "docs: open docs/_build/html/index.html"
