"""A job's memory, summed over its ranks: each rank forks its own workers, which each copy what they read of the
dataset, so the job holds ranks x workers copies; the job report says so once, with the saving over the job."""

from __future__ import annotations

import pytest

from fastfeed.doctor.jobreport import JobReport
from fastfeed.doctor.ranks import RankRecord
from fastfeed.doctor.timeline import EpochRecord, LoaderRecord, Timeline

MB = 2**20
ITEMS = ["items", "list", 1_000_000, 300 * MB]


def _rank(rank: int, uss_of, host: str = "node0", available_gb: int = 6) -> RankRecord:
    """A rank whose loader of 2 workers takes a batch of 64 every 10 ms for 4 s; ``uss_of(t)``: each worker's USS
    at ``t`` s, read every 0.5 s; its machine has 8 GB, ``available_gb`` of them available."""
    pids = [100 * (rank + 1) + 1, 100 * (rank + 1) + 2]
    asks = [0.01 * i for i in range(400)]
    epoch = EpochRecord(asks=asks, returns=[a + 0.008 for a in asks], pids=pids)
    rec = LoaderRecord(id=0, kind="torch", made_at="train.py:9", num_workers=2, prefetch_factor=2, batch_size=64,
                       epochs=[epoch], containers=[ITEMS])  # fmt: skip
    samples = []
    for k in range(1, 41):
        t, read = 0.1 * k, k % 5 == 0
        samples.append({"t": t, "dt": 0.1, "proc_cpu": {}, "mem_available": available_gb << 30 if read else None,
                        "proc_uss": {str(p): uss_of(t) for p in pids} if read else None})  # fmt: skip
    tl = Timeline(start=0.0, end=4.0, loaders=[rec], samples=samples, cpus=2, mem_total=8 << 30)
    return RankRecord(rank=rank, timeline=tl, host=host, local_rank=rank)


def copying(t):
    return 20 * MB + min(t, 3.0) * 40 * MB  # climbs with the batches read, then levels off once all is copied


def flat(t):
    return 20 * MB


def test_a_jobs_memory_sums_its_ranks_workers_and_share_is_advised_once_with_the_jobs_saving(tmp_path):
    job = JobReport([_rank(1, copying, available_gb=5), _rank(0, copying)])
    d = job.to_dict()
    m = d["job"]["memory"]
    per_rank = [v.verdict.memory for v in job.job.ranks]
    assert all(r["copy_on_read"] for r in per_rank)
    assert m["ranks"] == [0, 1] and m["workers"] == 4 and m["copying_workers"] == 4
    assert m["copy_on_read_ranks"] == [0, 1]
    assert m["workers_growth_bytes"] == sum(r["workers_growth_bytes"] for r in per_rank) == 4 * 100 * MB
    assert m["saving_bytes"] == sum(r["saving_bytes"] for r in per_rank)
    assert m["workers_end_bytes"] == sum(w["end_bytes"] for r in per_rank for w in r["workers"])
    assert m["hosts"] == [{"host": "node0", "ranks": [0, 1], "mem_total": 8 << 30, "available_min": 5 << 30,
                           "headroom": pytest.approx(5 / 8)}]  # the lowest either rank on the machine saw
    assert m["culprit"]["name"] == "items"
    share = [a for a in d["job"]["advice"] if a["change"] == "dataset = fastfeed.share(dataset)"]
    assert len(share) == 1, d["job"]["advice"]  # once for the job, not once per rank
    assert share[0]["predicted_saving_bytes"] == m["saving_bytes"] and share[0]["needs"]
    assert "4 workers over 2 ranks" in share[0]["why"] and "dataset.items" in share[0]["why"]
    text = job.summary(d)
    assert "memory, job: 4 workers over 2 ranks" in text and "copy-on-read on ranks 0, 1" in text
    assert "node0: 5,120 MB available at the lowest (62% headroom)" in text
    page = job.html(d)
    assert "memory, job: 4 workers over 2 ranks" in page


def test_only_the_ranks_that_copy_count_toward_the_saving_and_each_machine_keeps_its_own_headroom():
    job = JobReport([_rank(0, copying), _rank(1, flat, host="node1", available_gb=7)])
    m = job.to_dict()["job"]["memory"]
    assert m["copy_on_read_ranks"] == [0] and m["copying_workers"] == 2
    assert m["saving_bytes"] == job.job.ranks[0].verdict.memory["saving_bytes"]
    assert [(h["host"], h["available_min"]) for h in m["hosts"]] == [("node0", 6 << 30), ("node1", 7 << 30)]
    assert "copy-on-read on rank 0:" in job.summary()


def test_a_job_whose_workers_copy_nothing_gets_no_share_advice():
    d = JobReport([_rank(0, flat), _rank(1, flat)]).to_dict()
    assert d["job"]["memory"]["copy_on_read_ranks"] == [] and d["job"]["memory"]["saving_bytes"] is None
    assert not any("fastfeed.share" in a["change"] for a in d["job"]["advice"])
