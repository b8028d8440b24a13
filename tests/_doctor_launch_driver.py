"""``python _doctor_launch_driver.py OUT SCRIPT``: ``fastfeed doctor --nproc-per-node 2 --steps 8 --out OUT SCRIPT``
with two changes, so that a test sees both launches of a job and a port clash at each.

- The first port the launcher picks for each launch is one this process listens on (a port another process took
  between ``_free_port`` and the launcher's bind): the launch must go on some other way.
- The measured launch's decision is replaced by a closing setting, so that the closing launch runs whatever the
  tiny job's verdict.

It prints ``held port P`` and, at its end, ``held port picked N times``; the ranks print their own lines.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from fastfeed.cli import main
from fastfeed.doctor import launch

CLOSING = {"change": "num_workers=0", "setting": {"num_workers": 0}, "rank": 1, "predicted_gain": 1.0,
           "predicted_samples_per_s": None}  # fmt: skip


def run(out: str, script: str) -> int:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    print(f"held port {port}", flush=True)
    picked = []
    launched = []  # the launches that ran, each one's torchrun arguments
    free_port, real_launch = launch._free_port, launch.launch

    def held_first() -> int:
        # each launch's first pick (the first of all, or the first after a launch ran) is the held port
        if len(picked) == len(launched):
            picked.append(port)
            return port
        return free_port()

    def launch_and_close(args: list[str], directory: str) -> None:
        real_launch(args, directory)
        launched.append(args)
        if len(launched) == 1:
            (Path(directory) / "decision.json").write_text(json.dumps({"closing": CLOSING}))

    launch._free_port, launch.launch = held_first, launch_and_close
    try:
        code = main(["doctor", "--nproc-per-node", "2", "--steps", "8", "--out", out, script])
    finally:
        held.close()
    print(f"held port picked {len(picked)} times", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2]))
