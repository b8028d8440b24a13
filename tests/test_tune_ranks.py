"""Tuning under torch.distributed: every rank ends with the setting of the rank whose input is slowest.

The decision on fake results (ties, margins, the order of ranks, the store's protocol), then real jobs of 2 ranks
(torch's launcher, gloo on CPU) whose rank 1 reads slow samples: fastfeed.tune(), and num_workers="auto" in a loop
that meets at an all-reduce every step, as DDP does.
"""

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest

import _scripts
from fastfeed.tuning import agree
from fastfeed.tuning.agree import Pace, slowest
from fastfeed.tuning.result import Setting, Trial, TuneResult

pytestmark = pytest.mark.fastfeed_only

TESTS = os.path.dirname(os.path.abspath(__file__))


# -- the decision, on fake figures ---------------------------------------------------------------------------------


def test_slowest_is_the_rank_that_waits_most_for_input():
    """In lockstep every rank's rate is the same: the stall fraction names the straggler, whatever its rank."""
    assert slowest([Pace(0.03, 120.0), Pace(0.85, 120.0)]) == 1
    assert slowest([Pace(0.85, 120.0), Pace(0.03, 120.0), Pace(0.10, 120.0)]) == 0


def test_slowest_ties_go_to_the_lower_throughput_then_the_lower_rank():
    """Stalls within STALL_MARGIN tie (broken by the lower rate); rates within RATE_MARGIN tie (the lower rank)."""
    near = agree.STALL_MARGIN / 2
    assert slowest([Pace(0.99, 400.0), Pace(0.99 - near, 90.0)]) == 1  # no step: both only load; rank 1 is slower
    assert slowest([Pace(0.99 - near, 90.0), Pace(0.99, 400.0)]) == 0
    rate_near = 1 + agree.RATE_MARGIN / 2
    assert slowest([Pace(0.5, 100.0 * rate_near), Pace(0.5, 100.0)]) == 0
    assert slowest([Pace(0.5, 100.0), Pace(0.5, 100.0), Pace(0.5, 100.0)]) == 0
    # Just outside the margin, the stall alone decides, however low the other rank's rate.
    assert slowest([Pace(0.5, 10.0), Pace(0.5 + 1.5 * agree.STALL_MARGIN, 1000.0)]) == 1


def test_slowest_does_not_depend_on_the_order_of_comparison():
    """Margins do not chain: 0.50 ties 0.485, which ties 0.47, but 0.47 is no candidate. Every ordering of the same
    figures picks the same pace (the lowest rank among exact equals), so no rank can decide differently."""
    paces = [Pace(0.50, 100.0), Pace(0.485, 95.0), Pace(0.47, 10.0), Pace(0.485, 95.0), Pace(0.2, 5.0)]
    assert slowest(paces) == 1
    for order in itertools.permutations(range(len(paces))):
        shuffled = [paces[i] for i in order]
        chosen = slowest(shuffled)
        assert shuffled[chosen] == Pace(0.485, 95.0)
        assert chosen == min(k for k, p in enumerate(shuffled) if p == Pace(0.485, 95.0))
    with pytest.raises(ValueError):
        slowest([])


def _result(nw: int, first_stall: float, first_rate: float, elapsed_s: float) -> TuneResult:
    """A result whose first trial (at the setting every rank measures first) has the given figures."""
    first = Trial(Setting("process", 2, 2), [first_rate] * 3, stall_fraction=first_stall)
    chosen = Trial(Setting("process", nw, 2 if nw else None), [first_rate * 1.5] * 3, stall_fraction=0.01)
    return TuneResult(num_workers=nw, prefetch_factor=2 if nw else None, worker_type="process",
                      throughput=first_rate * 1.5, samples_per_s=None, stall_fraction=0.01, input_bound=True,
                      trials=[first, chosen], elapsed_s=elapsed_s, converged=True)  # fmt: skip


class _FakeStore:
    """The part of a c10d store agree uses, in a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def wait(self, keys):
        assert self.check(keys), "a rank would wait forever"


def test_every_rank_decides_alike_from_the_store(monkeypatch):
    """Three ranks publish through one store: until the last is in, poll says nothing; then every rank takes the same
    result, the one whose first trial stalled most (not the choice's figures, which compare different settings)."""
    store = _FakeStore()
    rank = {"now": 0}
    monkeypatch.setattr(agree, "_store", lambda: store)
    monkeypatch.setattr(agree.dist, "get_rank", lambda: rank["now"])
    monkeypatch.setattr(agree.dist, "get_world_size", lambda: 3)
    own = [_result(0, 0.03, 200.0, 1.0), _result(4, 0.60, 200.0, 2.0), _result(1, 0.30, 200.0, 3.0)]
    for r in range(3):
        rank["now"] = r
        assert agree.poll("t", own[r]) is None
        agree.publish(own[r], "t")
    decided = []
    for r in range(3):
        rank["now"] = r
        decided.append(agree.poll("t", own[r]))
    assert all(d.decided_by == 1 and d.setting == own[1].setting for d in decided)
    assert all(d.trials == own[1].trials and d.elapsed_s == 2.0 for d in decided)
    assert own[1].decided_by is None  # the rank's own result is left as it was
    rank["now"] = 2
    assert agree.slowest_on_all_ranks(own[2], "t").decided_by == 1
    assert "decided by rank 1" in str(decided[0])


def test_decided_by_is_kept_and_older_results_load_without_it():
    """as_dict / from_dict keep decided_by; a result saved before the field existed loads with None."""
    result = _result(2, 0.5, 100.0, 1.0)
    old = result.as_dict()
    del old["decided_by"]
    assert TuneResult.from_dict(old) == result and result.decided_by is None
    assert "decided by" not in str(result)
    decided = dataclasses.replace(result, decided_by=3)
    assert TuneResult.from_dict(json.loads(json.dumps(decided.as_dict()))).decided_by == 3


def test_one_process_keeps_its_own_result():
    """Without torch.distributed, agreement is the identity (no decided_by)."""
    result = _result(2, 0.5, 100.0, 1.0)
    assert agree.slowest_on_all_ranks(result, "t") is result
    assert agree.poll("t", result) is result


# -- real jobs: 2 ranks, rank 1's samples slow ------------------------------------------------------------------------

PREAMBLE = """
import dataclasses, json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_tune import Busy
import fastfeed

dist.init_process_group("gloo")
rank = dist.get_rank()
out = {out!r}


def dump(**what):  # one file each: stdout lines interleave
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
        json.dump(what, f)
"""

OFFLINE_SCRIPT = PREAMBLE + """
from fastfeed.tuning import offline

own = []
finish = offline.finish


def recording(*args, **kwargs):  # this rank's own result: what its search chose, before the ranks agree
    own.append(finish(*args, **kwargs))
    return own[-1]


offline.finish = recording
# Rank 1's samples sleep (I/O-like, so workers help it on any number of cores); rank 0's cost nothing. The step is a
# synthetic 5 ms: no collective, as the ranks run different trials.
ds = Busy(n=4000, sleep_s=0.004 if rank == 1 else 0.0)
result = fastfeed.tune(ds, batch_size=4, step=0.005, budget_s=12, max_workers=4)
dump(own=own[0].as_dict(), final=result.as_dict(), decided_by=getattr(result, "decided_by", None))
dist.destroy_process_group()
"""

ONLINE_SCRIPT = PREAMBLE + """
from torch.utils.data.distributed import DistributedSampler
from fastfeed.tuning.online import OnlineTuner

own = []
finish = OnlineTuner.finish


def recording(self, *args):  # this rank's own measurements and choice, before the ranks agree
    result = finish(self, *args)
    own.append({{"setting": dataclasses.asdict(self.search.choice()),
                "trials": [t.as_dict() for t in self.search.order]}})
    return result


OnlineTuner.finish = recording
ds = Busy(n=3200, sleep_s=0.002 if rank == 1 else 0.0)
loader = fastfeed.DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False), num_workers="auto")
grad = torch.zeros(16)
for epoch in range(8):
    for batch in loader:
        dist.all_reduce(grad)  # lockstep, as DDP's gradient all-reduce: rank 0 waits here for rank 1
    # Stop together (a rank that left would hang the other in its all-reduce) once every rank has agreed.
    tuner = loader._ff_tuner
    settled = torch.tensor([int(tuner is None or tuner.agreed)])
    dist.all_reduce(settled, op=dist.ReduceOp.MIN)
    if settled.item():
        break
result = loader.tune_result
dump(own=own[0], final=result.as_dict(), decided_by=getattr(result, "decided_by", None), epochs=epoch + 1,
     loader=[loader.num_workers, loader.prefetch_factor])
dist.destroy_process_group()
"""


def _run_ranks(tmp_path, script: str, timeout: float) -> list[dict]:
    """Run ``script`` on 2 ranks with torch's launcher; each rank's JSON, by rank. Kills the whole job on timeout."""
    path = tmp_path / "ranks.py"
    path.write_text(script.format(tests=TESTS, out=str(tmp_path)))
    env = dict(os.environ, OMP_NUM_THREADS="1", FASTFEED_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)]
    # A session of its own: on a timeout the launcher, its ranks and their workers all go, none is left behind.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    _, err, late = _scripts.communicate(proc, timeout)
    if late:
        pytest.fail(f"the job ran past {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _without_decision(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "decided_by"}


@pytest.mark.hang_limit(150)
def test_tune_takes_the_straggling_ranks_choice(tmp_path):
    """fastfeed.tune on 2 ranks, rank 1's input slow: both end with rank 1's own result, decided_by 1, which is not
    rank 0's own choice (its input keeps up with the step, so it would take fewer workers)."""
    a, b = _run_ranks(tmp_path, OFFLINE_SCRIPT, timeout=120)
    mine = TuneResult.from_dict(a["own"]).setting
    straggler = TuneResult.from_dict(b["own"]).setting
    assert mine != straggler, (mine, straggler)  # otherwise the test would not tell whose result was taken
    assert mine.num_workers < straggler.num_workers
    for rank in (a, b):
        assert rank["decided_by"] == 1
        assert _without_decision(rank["final"]) == _without_decision(b["own"])
    assert TuneResult.from_dict(a["final"]).setting == straggler


@pytest.mark.hang_limit(150)
def test_auto_in_lockstep_takes_the_straggling_ranks_choice(tmp_path):
    """num_workers="auto" on 2 ranks that all-reduce every step, rank 1's input slow: once every rank has agreed, both
    loaders run the setting chosen from rank 1's measurements, and their results say rank 1 decided."""
    a, b = _run_ranks(tmp_path, ONLINE_SCRIPT, timeout=120)
    straggler = Setting(**b["own"]["setting"])
    for rank in (a, b):
        assert rank["decided_by"] == 1
        final = TuneResult.from_dict(rank["final"])
        assert final.setting == straggler
        assert rank["final"]["trials"] == b["own"]["trials"]  # rank 1's measurements, on both ranks
        assert rank["loader"] == [final.num_workers, final.prefetch_factor]
    assert a["epochs"] == b["epochs"]
