#!/usr/bin/env bash
# Creates .venv (once) and installs torch 2.13 (the CPU wheel on this machine's disk),
# the test tools (pytest, with pytest-xdist to spread the suite over processes), Pillow (for benchmarks/jpeg.py),
# the [plot], [nvml], [remote] and [dali] extras (the doctor's PNG,
# its no-driver path, remote reads over HTTP and S3 and DALI's CPU pipelines are tested), Hugging Face Accelerate and
# torchdata (fastfeed through Accelerate.prepare is tested against them), Lightning (checkpoint/resume through
# Trainer.fit is tested),
# webdataset (tar shards are read and written both ways), moto's S3 server (fastfeed.io.Shards on S3), Ray (actor
# workers on a local cluster), the documentation site's build (docs/requirements.txt), Chromium where apt can install it
# (the doctor's HTML report is rendered in it) and fastfeed itself, built from csrc/.
# Safe to re-run: it only rebuilds the extension.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, numpy, pytest, pytest_timeout, xdist, hypothesis, pybind11, PIL, tqdm, matplotlib, pynvml, fsspec, aiohttp, nvidia.dali, accelerate, torchdata, webdataset, moto.server, s3fs, ray, psutil, lightning, sphinx, myst_parser, furo" 2>/dev/null; then
  # --no-compile: pip byte-compiles one module at a time (a minute on 2 cores); compileall below does it on every core.
  rm -f .venv/.byte-compiled
  .venv/bin/pip install -q --disable-pip-version-check --no-compile \
    "torch==2.13.0" numpy pytest pytest-timeout pytest-xdist hypothesis pillow tqdm matplotlib nvidia-ml-py fsspec aiohttp nvidia-dali-cuda120 accelerate torchdata webdataset "moto[server]" s3fs ray psutil lightning "pybind11>=2.12" "setuptools>=64" wheel -r docs/requirements.txt
fi
# Byte-compiled once, here: where PYTHONDONTWRITEBYTECODE is set (as on many CI machines and containers), Python
# never caches what it compiles, so every process the tests start (a spawned worker, a torchrun rank, a Ray actor)
# would compile torch afresh: 4.3 s of CPU for `import torch` instead of 1.8 s. A few files the packages ship are not
# Python 3 (templates, old tests) and fail to compile, as under pip; the stamp says the rest are done.
if [ ! -e .venv/.byte-compiled ]; then
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages >/dev/null || true
  touch .venv/.byte-compiled
fi
# Headless Chromium renders the doctor's HTML report in the tests; where it cannot be installed they skip, saying so.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "setup: chromium could not be installed; the HTML report's browser test will skip" >&2
fi
# No build isolation: the build uses the pybind11 and setuptools just installed,
# so it needs no network and takes seconds.
.venv/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
