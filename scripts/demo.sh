#!/usr/bin/env bash
# The main job: fastfeed against torch's DataLoader on built-in synthetic data,
# interleaved in one run, printing the ratios; then `fastfeed doctor` on its built-in scenario, ending with the verdict.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python benchmarks/demo.py "$@"
