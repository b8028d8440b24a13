#!/usr/bin/env bash
# The whole test suite (CPU only; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
rc=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=300 "$@" || rc=$?
# A test stuck where even its alarm cannot reach it is ended by faulthandler (tests/conftest.py), whose stack dump
# would otherwise be lost with pytest's captured output.
if [ "$rc" -ne 0 ] && [ -s .pytest-hang.txt ]; then
  echo "--- a test hung and the run was ended; its threads' stacks (.pytest-hang.txt):"
  cat .pytest-hang.txt
fi
exit "$rc"
