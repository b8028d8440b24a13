"""Builds fastfeed._C from csrc/. Metadata lives in pyproject.toml.

The extension links neither libtorch nor libcudart: it only speaks the buffer protocol, and
loads the CUDA runtime with dlopen when asked to (csrc/cuda.cpp), so one build serves every
torch version and machines with or without CUDA.
"""

import sys
from glob import glob

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

ext = Pybind11Extension(
    "fastfeed._C",
    sorted(glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O2"],
    # shm_open (librt) and dlopen (libdl) live apart before glibc 2.34; the stubs are harmless after.
    libraries=["rt", "dl"] if sys.platform.startswith("linux") else [],
)

setup(ext_modules=[ext])
