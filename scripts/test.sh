#!/usr/bin/env bash
# The whole test suite (CPU only; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=300 "$@"
