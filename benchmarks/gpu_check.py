"""`fastfeed bench gpu` runs the same code on a CUDA machine: fastfeed/bench/suites/gpu.py says what it checks."""

from fastfeed.bench.suites.gpu import main

if __name__ == "__main__":
    main()
