"""One copy per machine: the local ranks of a torch.distributed job agree on who writes a block.

The first local rank to arrive (``store.add`` returns 1) writes the block and publishes its handle under a
node-local key in the job's store; the others wait for the handle and map the block through /proc. The key is
made of the job (TORCHELASTIC_RUN_ID and restart count), this machine (boot id, pid namespace) and the caller's
key or a fingerprint of the content. It need not be secret: the handle opens nothing by itself, since the kernel
lets only this user's processes open another process's descriptors, and the handle's inode is checked.

The store is the initialised process group's, else torchrun's agent store (MASTER_ADDR/MASTER_PORT with
TORCHELASTIC_USE_AGENT_STORE), else there is none and each process keeps its own copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from datetime import timedelta

from .memory import HOST, Handle

WAIT_S = float(os.environ.get("FASTFEED_SHARE_WAIT_S", 1800))  # for the writer: pickling 1M items takes seconds


def local_world_size() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _store():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=WAIT_S))
    return None


def fingerprint(obj, kind: str) -> str:
    """A cheap content key: the kind, length and pickles of up to 64 items spread over the container.

    Ranks sharing the same container in the same order find each other's block with it; pickling everything
    to hash it would cost the non-writers what sharing saves them.
    """
    h = hashlib.blake2b(digest_size=12)
    n = len(obj)
    h.update(f"{kind}:{n}".encode())
    step = max(1, n // 64)
    if isinstance(obj, dict):
        keys = list(obj)  # O(n) but a fraction of the pickling the writer does
        picks = [(keys[i], obj[keys[i]]) for i in range(0, n, step)]
    else:
        picks = [obj[i] for i in range(0, n, step)]
    for item in picks:
        try:
            h.update(pickle.dumps(item, protocol=4))
        except Exception:
            h.update(repr(type(item)).encode())
    return h.hexdigest()


class Rendezvous:
    """Who writes a block among the local ranks, and the handle they all map."""

    def __init__(self, store, key: str):
        self.store = store
        job = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        node = hashlib.blake2b(HOST.encode(), digest_size=8).hexdigest()
        self.prefix = f"fastfeed/share/{job}/{node}/{key}"

    @classmethod
    def for_job(cls, key: str) -> Rendezvous | None:
        """The rendezvous of this machine's ranks, or None when this process is alone on it (or has no store)."""
        if local_world_size() <= 1:
            return None
        store = _store()
        return None if store is None else cls(store, key)

    def first(self) -> bool:
        """Whether this process arrived first (and so writes the block)."""
        return self.store.add(self.prefix + "/arrived", 1) == 1

    def publish(self, handle: Handle) -> None:
        self.store.set(self.prefix + "/handle", json.dumps(list(handle)))

    def fail(self, message: str) -> None:
        """Tell the waiting ranks that the writer failed, rather than leave them waiting."""
        self.store.set(self.prefix + "/handle", json.dumps({"error": message}))

    def wait(self) -> Handle:
        try:
            self.store.wait([self.prefix + "/handle"], timedelta(seconds=WAIT_S))
        except Exception as e:
            raise RuntimeError(
                f"fastfeed.share: waited {WAIT_S:.0f} s for the local rank writing '{self.prefix}' to publish it "
                "(it died, or the ranks did not call fastfeed.share on the same containers in the same order). "
                "Call it on every rank alike, or give each call the same key= on every rank; "
                "FASTFEED_SHARE_WAIT_S sets the wait."
            ) from e
        value = json.loads(self.store.get(self.prefix + "/handle"))
        if isinstance(value, dict):
            raise RuntimeError(f"fastfeed.share: the local rank writing the shared copy failed: {value['error']}")
        return Handle(*value)
