"""Processes for tests/test_share.py: a holder of a shared list, an attacher, and a torchrun rank.

  hold N            share N items, print the handle (pickled, hex) on one line, then sleep until killed
  attach HEX        unpickle the shared list, check its items, print "ok N", then sleep until killed
  interrupt N       share N items in a loop until SIGINT (Ctrl-C) lands, mid-build or not
  rank N OUT        under torchrun: share N items before init_process_group (torchrun's agent store), then
                    report this rank's block inode and a check of its items (rank 0 writes OUT)
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import sys
import time

import fastfeed


def items(n: int) -> list:
    return [{"file": f"img_{i}.jpg", "label": i % 10} for i in range(n)]


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that finds this job stuck asks where, first
    mode = sys.argv[1]
    if mode == "hold":
        shared = fastfeed.share(items(int(sys.argv[2])))
        print(pickle.dumps(shared).hex(), flush=True)
        time.sleep(600)
    elif mode == "attach":
        shared = pickle.loads(bytes.fromhex(sys.argv[2]))
        n = len(shared)
        assert shared[n - 1] == {"file": f"img_{n - 1}.jpg", "label": (n - 1) % 10}, shared[n - 1]
        print(f"ok {n}", flush=True)
        time.sleep(600)
    elif mode == "interrupt":
        data = items(int(sys.argv[2]))
        print("ready", flush=True)
        while True:
            fastfeed.share(data)
    elif mode == "rank":
        n, out = int(sys.argv[2]), sys.argv[3]
        shared = fastfeed.share(items(n))  # before the process group: torchrun's own store is the rendezvous
        ok = shared[n // 2] == {"file": f"img_{n // 2}.jpg", "label": (n // 2) % 10} and len(shared) == n
        import torch.distributed as dist

        dist.init_process_group("gloo")
        report = [None] * dist.get_world_size()
        dist.all_gather_object(report, {"rank": dist.get_rank(), "ok": ok, "block": list(shared.handle[3:5]),
                                        "pid": os.getpid(), "holder": shared.handle.pid})  # fmt: skip
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(report, f)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
