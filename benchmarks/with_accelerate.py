"""The Accelerate benchmark; kept beside the others for the commands in benchmarks/README.md.

What it measures, and the figures measured: fastfeed.bench.suites.with_accelerate.py.
"""

from fastfeed.bench.suites.with_accelerate import main

if __name__ == "__main__":
    main()
