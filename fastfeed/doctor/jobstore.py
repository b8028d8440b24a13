"""How a job's ranks hand their records to rank 0: the job's own key-value store, never a collective.

A collective of the doctor's, issued after the measured run, could pair up with one of the training loop's on a
rank that is still in it (a rank stopped by an exception, or one whose script goes on after its loop): the store
cannot. Under torch's elastic launcher (torchrun, ``fastfeed doctor --nproc-per-node``) the launcher on node 0
hosts a TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE``), which outlives the script's process
group; the doctor connects to it as one more client, under a prefix of its own. Other launchers: the store of
the script's default process group, captured while the script ran (``capture``).

Clocks: each rank's times are its own ``time.perf_counter`` (CLOCK_MONOTONIC). Rank 0's is the job's clock;
each other rank estimates its offset by Cristian's method through the store: it posts a request, rank 0 answers
with its clock, and the round trip with the shortest time bounds the error by half of it (well under a
millisecond on one machine or a LAN, against steps of tens of milliseconds).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import zlib
from datetime import timedelta

import torch.distributed as dist

from .ranks import RankRecord

ROUNDS = 8  # clock round trips per rank; the shortest one is kept
WAIT_S = 600.0  # how long rank 0 waits for a rank's records (the launcher ends the job on a rank's failure)
_captured: list = []  # the default process group's store, once the script made one


class JobError(RuntimeError):
    """The ranks' records could not be gathered."""


def job_env() -> dict | None:
    """``{"rank", "world", "local_rank"}`` from torchrun's environment for a job of more than one rank, else None."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None
    if world < 2:
        return None
    return {"rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0)}


def capture() -> None:
    """Keep the default process group's store (called at each watched batch; cheap once it is kept)."""
    if not _captured and dist.is_available() and dist.is_initialized():
        _captured.append(dist.distributed_c10d._get_default_store())


def run_prefix(env=os.environ, prefix: str = "fastfeed/doctor") -> str:
    """Where this launch's keys go in the job's store: under ``prefix``, the launch's run id (torchrun's
    ``--rdzv-id``, distinct for each of ``fastfeed doctor``'s launches) and its restart count, from ``env``."""
    return f"{prefix}/{env.get('TORCHELASTIC_RUN_ID', 'job')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def connect(prefix: str = "fastfeed/doctor") -> dist.Store:
    """The job's store, under ``prefix`` and this launch's run id and restart count (``run_prefix``)."""
    run = run_prefix(os.environ, prefix)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=WAIT_S))  # fmt: skip
    elif _captured:
        store = _captured[0]
    else:
        raise JobError("the doctor found no store to gather the ranks' records through: run the job under torchrun "
                       "(or fastfeed doctor --nproc-per-node N), or have the script call init_process_group")
    return dist.PrefixStore(run, store)


def _pack(value) -> bytes:
    return zlib.compress(json.dumps(value, default=str).encode(), 1)


def _unpack(data: bytes):
    return json.loads(zlib.decompress(data))


def offset_to_rank0(store: dist.Store, rank: int) -> float:
    """On rank ``rank`` > 0: seconds to add to this clock to read rank 0's (rank 0 answers in ``serve_clock``)."""
    best = None
    for i in range(ROUNDS):
        t0 = time.perf_counter()
        store.set(f"clock/{rank}/{i}/ask", b"")
        theirs = float(store.get(f"clock/{rank}/{i}/answer"))
        t1 = time.perf_counter()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, theirs - (t0 + t1) / 2)
    return best[1]


def serve_clock(store: dist.Store, world: int) -> None:
    """On rank 0: answer each other rank's clock requests in turn."""
    for rank in range(1, world):
        for i in range(ROUNDS):
            store.wait([f"clock/{rank}/{i}/ask"])
            store.set(f"clock/{rank}/{i}/answer", repr(time.perf_counter()).encode())


def publish(store: dist.Store, record: RankRecord) -> None:
    store.set(f"rank/{record.rank}", _pack(record.to_dict()))


def gather(store: dist.Store, own: RankRecord, world: int) -> list[RankRecord]:
    """On rank 0: every rank's record, in rank order (its own first). Raises JobError naming ranks that never
    published within ``WAIT_S``."""
    records = [own]
    for rank in range(1, world):
        try:
            store.wait([f"rank/{rank}"], timedelta(seconds=WAIT_S))
        except dist.DistStoreError as e:  # a timeout
            raise JobError(f"rank {rank} sent the doctor no records within {WAIT_S:.0f} s ({e})") from e
        records.append(RankRecord.from_dict(_unpack(store.get(f"rank/{rank}"))))
    return records


def post_decision(store: dist.Store, decision: dict) -> None:
    """On rank 0: what the job's launchers do next (the closing launch's setting), for every rank to read."""
    store.set("decision", _pack(decision))


def read_decision(store: dist.Store) -> dict:
    return _unpack(store.get("decision"))


def host() -> str:
    return socket.gethostname()


def cuda_used() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())
