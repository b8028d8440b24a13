#!/usr/bin/env bash
# The GPU check in one command, on a bare GPU machine (no network, no install, no .venv: setup.sh pins the CPU
# wheel): builds the extension in place with this machine's python3 (or $PYTHON), then runs tests/test_gpu.py and
# every check of fastfeed/bench/gpu/, a line per figure, and writes DIR/gpu_check.json.
#
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run] [--only ID,ID] [--num-workers N]
#
# --dry-run runs every check on a CPU against fakes (tests/fake_cudart.c for registration), with tiny sizes.
# Exit: 0 every check held; 1 a check, bar or test failed; 2 no CUDA device; 3 a GPU torch cannot use.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
for arg in "$@"; do
  [[ $arg == --dry-run ]] && dry=1
done

# A machine with no trace of an NVIDIA GPU has nothing to check, whatever its python holds.
if [[ $dry == 0 ]] && ! ls /dev/nvidia[0-9]* /proc/driver/nvidia/gpus/* >/dev/null 2>&1 \
    && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device here (no /dev/nvidia*, no /proc/driver/nvidia/gpus, no nvidia-smi); nothing measured"
  exit 2
fi

# The machine's python3; on a developer's machine without torch there, the project's venv (for --dry-run).
PY=${PYTHON:-python3}
if [[ -z ${PYTHON:-} ]] && ! python3 -c "import torch" 2>/dev/null && [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY cannot import torch; set PYTHON to a python with a CUDA build of torch" >&2
  exit 1
fi

# Build only when the extension is missing or older than its sources: rewriting a loaded .so in place would
# crash the processes that have it mapped.
so=$("$PY" -c "import importlib.util as u; s = u.find_spec('fastfeed._C'); print(s.origin if s else '')" 2>/dev/null)
if [[ -z $so ]] || [[ -n $(find csrc setup.py -newer "$so" -print -quit) ]]; then
  echo "gpu_check: building the extension with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  if ! "$PY" setup.py build_ext --inplace -q >/dev/null; then
    echo "gpu_check: FAIL: building the extension failed (it needs a C++17 compiler and pybind11)" >&2
    exit 1
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ $dry == 1 ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cc=${CC:-cc}
  command -v "$cc" >/dev/null || cc=gcc
  if "$cc" -shared -fPIC -O1 -o "$tmp/libcudart_fake.so" tests/fake_cudart.c; then
    export FASTFEED_CUDART="$tmp/libcudart_fake.so"  # registration against the fake runtime
  else
    echo "gpu_check: no C compiler for tests/fake_cudart.c: the dry run's registration check will say so" >&2
  fi
fi

# The checks stop themselves within their budget; this is the backstop for a hang outside them.
runner=()
command -v timeout >/dev/null && runner=(timeout --kill-after=10 460)
${runner[@]+"${runner[@]}"} "$PY" -m fastfeed.bench.suites.gpu --tests tests/test_gpu.py "$@"
rc=$?
if [[ $rc == 124 || $rc == 137 ]]; then
  echo "gpu_check: FAIL: stopped after 460 s (the report holds the checks that finished)" >&2
  rc=1
fi
exit $rc
