"""The GPU check's measurements (fastfeed/bench/gpu/ says what each checks); its exit code is theirs.

bash scripts/gpu_check.sh also builds the extension and runs tests/test_gpu.py first.
"""

import sys

from fastfeed.bench.suites.gpu import main

if __name__ == "__main__":
    sys.exit(main())
