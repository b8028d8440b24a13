#!/usr/bin/env bash
# The whole test suite (CPU only; GPU tests skip without CUDA), its tests spread over worker processes.
#   bash scripts/test.sh            every test (the README's command; CI runs it)
#   bash scripts/test.sh --quick    the quick tier, for iterating: every module but SLOW_MODULES (tests/conftest.py)
# Further arguments go to pytest (a file, -k EXPR, -x ...). FASTFEED_TEST_WORKERS sets the number of pytest-xdist
# workers (default: the cores, at least 2 and at most 4; 1 runs in this process, without xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m "not slow")
fi
# Most tests wait on processes they start (workers, torchrun ranks, Ray actors), so two workers help even on two
# cores; more than four would mostly add contention for the cores those processes need.
cores=$(nproc 2>/dev/null || echo 2)
workers=${FASTFEED_TEST_WORKERS:-$(( cores < 2 ? 2 : (cores > 4 ? 4 : cores) ))}
spread=()
if [ "$workers" -gt 1 ]; then
  # --dist loadfile: a module's tests run in one worker, in order, so module-scoped fixtures (a Ray cluster, a
  # torchrun job's output) are made once, as in a run without xdist.
  spread=(-n "$workers" --dist loadfile)
fi
rm -f .pytest-hang*.txt
rc=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider --timeout=300 ${spread[@]+"${spread[@]}"} ${tier[@]+"${tier[@]}"} "$@" || rc=$?
# A test stuck where even its alarm cannot reach it is ended by faulthandler (tests/conftest.py), whose stack dump
# would otherwise be lost with pytest's captured output; each xdist worker writes its own file.
if [ "$rc" -ne 0 ]; then
  for dump in .pytest-hang*.txt; do
    if [ -s "$dump" ]; then
      echo "--- a test hung and its worker was ended; its threads' stacks ($dump):"
      cat "$dump"
    fi
  done
fi
exit "$rc"
