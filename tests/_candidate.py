"""The DataLoader under test: fastfeed's, or torch's own when FASTFEED_TEST_AGAINST_TORCH=1.

Running the suite against torch proves that every parity expectation holds for the
reference implementation itself; fastfeed-only behaviours are skipped in that mode.
Datasets import this module too, so workers (forked or spawned; the environment is
inherited either way) resolve the same candidate as the test process.
"""

import os

import torch.utils.data

AGAINST_TORCH = os.environ.get("FASTFEED_TEST_AGAINST_TORCH", "") not in ("", "0")

if AGAINST_TORCH:
    NAME = "torch"
    DataLoader = torch.utils.data.DataLoader
    get_worker_info = torch.utils.data.get_worker_info
    # torch has no ring, so it never warns about growing one.
    RingGrowthWarning = None
else:
    import fastfeed

    NAME = "fastfeed"
    DataLoader = fastfeed.DataLoader
    get_worker_info = fastfeed.get_worker_info
    # Looked up softly so that a missing export fails only the tests that need it.
    RingGrowthWarning = getattr(fastfeed, "RingGrowthWarning", None)
