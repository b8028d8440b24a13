"""torch.distributed.checkpoint (DCP) saves and restores a fastfeed loader exactly, as torchtitan / FSDP2 code does:
``dcp.save({"loader": dl}, checkpoint_id=...)``, then in a new process ``dcp.load({"loader": fresh}, ...)`` into a
loader built with the same arguments and never iterated (DCP loads *into* the structure of the live object's
``state_dict()``).

Each test compares sample sequences with an uninterrupted run's: the dataset returns its index and a random value
drawn where the sample is made (``torch.rand(1)`` in a worker, or in the main process with num_workers=0), so a
resumed run must give back the order and the RNG streams bit for bit. Without an initialised process group DCP
saves and loads in this process alone (``no_dist`` is implied); the torchrun tests (tests/_dcp_job.py, gloo, CPU)
save on every rank and load on the same or another number of ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import _dcp_job
import _scripts
import _shards
from _dcp_job import IndexRand, as_lists
from fastfeed import DataLoader

pytestmark = pytest.mark.fastfeed_only

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS_DIR, "_dcp_job.py")

N = 22  # samples: batches of 3, the last of 1 (8 a epoch)
BATCH = 3
K = 3  # batches received before the save
SEED = 1234
OTHER_SEED = 999  # the "new process" starts from another seed: the checkpoint must set the RNGs
CONFIGS = {
    "nw0": {"num_workers": 0},
    "nw2": {"num_workers": 2},
    "nw2-persistent": {"num_workers": 2, "persistent_workers": True},
}
PLAIN = ["nw0", "nw2"]


def make(config: str | dict, **overrides) -> DataLoader:
    kw = dict(CONFIGS[config] if isinstance(config, str) else config, **overrides)
    return DataLoader(IndexRand(N), batch_size=BATCH, shuffle=True, **kw)


def epoch(loader) -> list:
    return [as_lists(b) for b in loader]


def reference(config, epochs: int = 3) -> list:
    """The uninterrupted run: ``epochs`` epochs of [[indices], [random values]] per batch."""
    torch.manual_seed(SEED)
    loader = make(config)
    return [epoch(loader) for _ in range(epochs)]


def fresh(config, **overrides) -> DataLoader:
    """The loader a restarted job builds: same arguments, another seed, never iterated."""
    torch.manual_seed(OTHER_SEED)
    return make(config, **overrides)


def save(loader, path) -> None:
    assert not dist.is_initialized()  # no process group: DCP saves in this process alone
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({"loader": loader}, checkpoint_id=str(path))


def load(loader, path) -> None:
    assert not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load({"loader": loader}, checkpoint_id=str(path))


def stopped_after_break(config, k: int = K) -> tuple[DataLoader, list]:
    """The run, stopped by a ``break`` after ``k`` batches of epoch 0: (its loader, the batches received)."""
    torch.manual_seed(SEED)
    loader = make(config)
    seen = []
    for batch in loader:
        seen.append(as_lists(batch))
        if len(seen) == k:
            break
    return loader, seen


def resumed(config, ckpt) -> list:
    """A fresh loader dcp.load-ed from ``ckpt``: the two epochs it yields (the first may be the rest of one)."""
    new = fresh(config)
    load(new, ckpt)
    return [epoch(new), epoch(new)]


# -- one process, no process group --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", PLAIN)
def test_a_save_inside_the_loop_loads_into_a_fresh_loader_and_continues_exactly(tmp_path, config):
    """dcp.save after batch K (inside the loop, the run going on), dcp.load into a fresh loader: batches K+1.. of
    the epoch and the next epoch, indices and random values bit for bit; the saving run itself is unchanged."""
    ref = reference(config)
    torch.manual_seed(SEED)
    loader = make(config)
    run = [[]]
    for batch in loader:
        run[0].append(as_lists(batch))
        if len(run[0]) == K:
            save(loader, tmp_path / "ckpt")
    run += [epoch(loader), epoch(loader)]
    assert run == ref, "dcp.save changed the run that saved"
    del loader
    assert resumed(config, tmp_path / "ckpt") == [ref[0][K:], ref[1]]


@pytest.mark.parametrize("config", PLAIN)
def test_a_save_after_break_loads_into_a_fresh_loader_and_continues_exactly(tmp_path, config):
    """The loop broken after batch K, then dcp.save: a fresh loader continues with batch K+1, then epoch 1."""
    ref = reference(config)
    loader, seen = stopped_after_break(config)
    assert seen == ref[0][:K]
    save(loader, tmp_path / "ckpt")
    del loader
    assert resumed(config, tmp_path / "ckpt") == [ref[0][K:], ref[1]]


@pytest.mark.parametrize("config", PLAIN)
def test_a_save_before_the_first_iter_starts_epoch_zero(tmp_path, config):
    """dcp.save of a loader never iterated: the fresh loader's first two epochs are the uninterrupted run's."""
    ref = reference(config)
    torch.manual_seed(SEED)
    loader = make(config)
    save(loader, tmp_path / "ckpt")
    del loader
    assert resumed(config, tmp_path / "ckpt") == ref[:2]


@pytest.mark.parametrize("config", PLAIN)
def test_a_save_between_epochs_starts_the_next_epoch(tmp_path, config):
    """dcp.save after epoch 0 ended: the fresh loader's epochs are the run's epochs 1 and 2."""
    ref = reference(config)
    torch.manual_seed(SEED)
    loader = make(config)
    assert epoch(loader) == ref[0]
    save(loader, tmp_path / "ckpt")
    del loader
    assert resumed(config, tmp_path / "ckpt") == ref[1:]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_load_into_a_loader_that_ran_an_epoch_continues_exactly(tmp_path, config):
    """dcp.load of a mid-epoch checkpoint into a loader that already ran an epoch (its workers still up where
    persistent): the loaded position wins, batches K+1.. and the next epoch as uninterrupted."""
    ref = reference(config)
    loader, _ = stopped_after_break(config)
    save(loader, tmp_path / "ckpt")
    del loader
    used = fresh(config)
    assert len(epoch(used)) == len(ref[0])
    load(used, tmp_path / "ckpt")
    assert epoch(used) == ref[0][K:]
    assert epoch(used) == ref[1]



def _dcp_keys(loader) -> dict:
    """The keys DCP flattens ``{"loader": loader}``'s state into, with their values' types: DCP loads *into* these,
    so a key a checkpoint has and a fresh loader's state lacks (or the reverse) is lost or fails the load."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({"loader": loader.state_dict()})
    return {key: type(value).__name__ for key, value in flat.items()}


LEAVES = {"int", "bool", "str", "NoneType", "list", "tuple"}  # values DCP stores whole (a tensor it would shard)


@pytest.mark.parametrize("kw", [{}, {"num_workers": 2, "worker_type": "thread"},
                                {"num_workers": 2, "worker_type": "thread", "in_order": False},
                                {"generator": "seeded"}], ids=["nw0", "threads", "threads-unordered", "generator"])
def test_the_state_has_the_same_keys_at_every_point_for_dcp_to_load_into(kw):
    """A loader's state flattens to the same DCP keys fresh, after iter(), mid-epoch, after a break, between epochs
    and once loaded; every key of ``_state.KEYS`` is there and each value is one DCP stores whole. Guards against a
    part of the state present only at some points (the sampler RNGs before the first draw, say), which DCP would
    fail to load into a fresh loader or silently leave out. In this process: no worker process is started."""
    from fastfeed import _state

    kw = dict(kw)
    if kw.pop("generator", None):
        kw["generator"] = torch.Generator().manual_seed(5)
    torch.manual_seed(SEED)
    loader = DataLoader(IndexRand(N), batch_size=BATCH, shuffle=True, **kw)
    points = {"fresh": _dcp_keys(loader)}
    it = iter(loader)
    points["after iter()"] = _dcp_keys(loader)
    next(it), next(it)
    points["mid-epoch"] = _dcp_keys(loader)
    saved = loader.state_dict()
    del it
    points["after a break"] = _dcp_keys(loader)
    for _ in loader:
        pass
    points["between epochs"] = _dcp_keys(loader)
    again = DataLoader(IndexRand(N), batch_size=BATCH, shuffle=True, **kw)
    again.load_state_dict(json.loads(json.dumps(saved)))
    points["loaded"] = _dcp_keys(again)
    keys = set(points["fresh"])
    assert keys == {f"loader.{k}" for k in _state.KEYS if k not in ("rng", "sampler_rng")} | {
        "loader.rng.torch", "loader.rng.random", "loader.rng.numpy", "loader.rng.generator",
        "loader.sampler_rng.torch", "loader.sampler_rng.generator"}  # fmt: skip
    for name, found in points.items():
        assert set(found) == keys, name
        assert set(found.values()) <= LEAVES, (name, found)

@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdata_stateful_loader_resumes_through_dcp_the_reference(tmp_path, num_workers):
    """The reference: torchdata's StatefulDataLoader, saved after batch K and loaded into a fresh one through DCP,
    continues the epoch's order (indices only: it does not put back the RNG streams a sample draws from)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def sdl():
        return StatefulDataLoader(IndexRand(N), batch_size=BATCH, shuffle=True, num_workers=num_workers)

    def indices(loader):
        return [b[0] for b in epoch(loader)]

    torch.manual_seed(SEED)
    loader = sdl()
    ref = [indices(loader), indices(loader)]
    torch.manual_seed(SEED)
    loader = sdl()
    seen = []
    for batch in loader:
        seen.append(as_lists(batch)[0])
        if len(seen) == K:
            break
    assert seen == ref[0][:K]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.save({"loader": loader}, checkpoint_id=str(tmp_path / "ckpt"))
        del loader
        torch.manual_seed(OTHER_SEED)  # the epoch's order comes from the checkpoint
        new = sdl()
        dcp.load({"loader": new}, checkpoint_id=str(tmp_path / "ckpt"))
        assert indices(new) == ref[0][K:]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_checkpoint_of_two_workers_continues_the_epoch_with_three(tmp_path):
    """Map-style, saved mid-epoch with num_workers=2, loaded through DCP into a fresh loader with num_workers=3:
    the epoch's indices continue exactly, then the next epoch's; and the batches (random values included) are
    those of the same state loaded by hand (load_state_dict)."""
    ref = reference("nw2")
    loader, seen = stopped_after_break("nw2")
    assert seen == ref[0][:K]
    by_hand_state = loader.state_dict()
    save(loader, tmp_path / "ckpt")
    del loader
    by_hand = fresh("nw2", num_workers=3)
    by_hand.load_state_dict(by_hand_state)
    expected = [epoch(by_hand), epoch(by_hand)]
    del by_hand
    new = fresh("nw2", num_workers=3)
    load(new, tmp_path / "ckpt")
    got = [epoch(new), epoch(new)]
    assert [[b[0] for b in e] for e in got] == [[b[0] for b in ref[0][K:]], [b[0] for b in ref[1]]]
    assert got == expected


# -- torchrun: 2 ranks with a DistributedSampler, fastfeed.io.Shards on 4 ranks -> 2 and 2 -> 2 -------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(world: int, mode: str, out, shard_dir: str, timeout: float = 150) -> str | None:
    """Run tests/_dcp_job.py MODE on ``world`` gloo ranks; None, or what went wrong (the job killed whole on a
    timeout: launcher, ranks and their workers)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr",
           "127.0.0.1", "--master-port", str(_port()), JOB, mode, str(out), shard_dir]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        os.environ.get("PYTHONPATH"), TESTS_DIR, os.path.dirname(TESTS_DIR)])))  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    _, err, late = _scripts.communicate(proc, timeout)
    if late:
        return f"torchrun {mode} ran past {timeout} s:\n{err[-4000:]}"
    return None if proc.returncode == 0 else f"torchrun {mode} exited {proc.returncode}:\n{err[-4000:]}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The three launches, in order (save4 on 4 ranks, save2 and load2 on 2). ``.part(name, world)``: each rank's
    report of a part, or the test fails with the part's error (or the launch's); ``.shard_dir``: the shards read."""
    shard_dir = str(tmp_path_factory.mktemp("dcp_shards"))
    _shards.make(shard_dir)
    out = tmp_path_factory.mktemp("dcp_job")
    launches = {mode: _torchrun(world, mode, out, shard_dir) for world, mode in ((4, "save4"), (2, "save2"),
                                                                                  (2, "load2"))}  # fmt: skip
    mode_of = {part.__name__: mode for mode, parts in _dcp_job.MODES.items() for part in parts}

    def part(name: str, world: int) -> list[dict]:
        reports = []
        for rank in range(world):
            path = out / f"{name}.{rank}.json"
            if not path.exists():
                pytest.fail(f"no report from part {name} on rank {rank}; {launches[mode_of[name]]}")
            report = json.loads(path.read_text())
            if not report["ok"]:
                pytest.fail(f"part {name} failed on rank {rank}: {report['error']}\n{report['traceback']}")
            reports.append(report)
        return reports

    return types.SimpleNamespace(part=part, shard_dir=shard_dir)


@pytest.mark.hang_limit(400)
def test_torchrun_each_rank_resumes_its_own_sequence_from_one_dcp_checkpoint(job):
    """2 gloo ranks, DistributedSampler(shuffle=True) and num_workers=2, each rank seeded apart: every rank saves
    through dcp.save after K batches; in a second launch fresh loaders dcp.load it, and each rank's batches
    (indices and worker-drawn random values) are its own uninterrupted ones, to the end of the next epoch."""
    refs, saves, loads = (job.part(name, 2) for name in ("sampler_ref", "sampler_save", "sampler_load"))
    k = _dcp_job.SAMPLER_STOP
    for rank in (0, 1):
        ref = refs[rank]["epochs"]
        assert saves[rank]["before"] == ref[0][:k], f"rank {rank}: the saving run is not the reference"
        assert loads[rank]["epochs"][0] == ref[0][k:], f"rank {rank}: the rest of epoch 0"
        assert loads[rank]["epochs"][1] == ref[1], f"rank {rank}: epoch 1"
    # The ranks' states truly differ (a checkpoint of one rank's state loaded on both would fail above).
    for e in (0, 1):
        (i0, r0), (i1, r1) = ([sum((b[j] for b in refs[rank]["epochs"][e]), []) for j in (0, 1)] for rank in (0, 1))
        assert not set(i0) & set(i1) and sorted(i0 + i1) == list(range(_dcp_job.SAMPLER_N))
        assert r0 != r1


def _shards_reference(shard_dir: str, world: int, epoch: int) -> list[int]:
    """The global sequence ``world`` ranks yield in ``epoch`` uninterrupted (ranks simulated by rank=/world_size=),
    at the job's global batch."""
    from fastfeed.io import Shards

    per_rank = []
    for rank in range(world):
        ds = Shards(shard_dir, decode=_shards.as_tensor, shuffle=True, seed=_dcp_job.SHARDS_SEED,
                    shuffle_window=3, rank=rank, world_size=world)  # fmt: skip
        ds.set_epoch(epoch)
        per_rank.append([b.tolist() for b in DataLoader(ds, batch_size=_dcp_job.SHARDS_GLOBAL_BATCH // world)])
    return _shards.interleave(per_rank)


@pytest.mark.hang_limit(400)
@pytest.mark.parametrize("saved_on,part", [(4, "shards4to2"), (2, "shards2to2")])
def test_torchrun_shards_saved_on_some_ranks_resume_on_two_with_the_same_global_batches(job, saved_on, part):
    """fastfeed.io.Shards, global batch 8: saved through DCP on ``saved_on`` ranks after 3 batches each, loaded
    into fresh loaders on 2 ranks (batch 4): together the 2 ranks yield the global batches the saving ranks would
    have yielded for the rest of the epoch, each sample once (past the padding), and the next epoch as well.
    2 -> 2: each rank's training loop draws after dcp.load what it drew after dcp.save (its own RNGs back)."""
    n = sum(_shards.UNEQUAL)
    saved = job.part("shards4" if saved_on == 4 else "shards2", saved_on)
    loaded = job.part(part, 2)
    ref = [_shards_reference(job.shard_dir, saved_on, e) for e in (0, 1)]
    before = _shards.interleave([r["before"] for r in saved])
    assert before == ref[0][:len(before)], "the saving run is not the reference"
    assert {r["first_epoch"] for r in loaded} == {0}
    after = [_shards.interleave([r["epochs"][e] for r in loaded]) for e in (0, 1)]
    assert {len(b) for r in loaded for e in r["epochs"] for b in e} == {4}
    assert before + after[0] == ref[0]
    whole = before + after[0]
    assert sorted(whole[:n]) == list(range(n)) and whole[n:] == whole[:len(whole) - n]
    assert after[1] == ref[1]
    if saved_on == 2:  # each rank's own RNGs back (DCP must not hand every rank one rank's state)
        assert [r["user_draws"] for r in loaded] == [r["user_draws"] for r in saved]
        assert saved[0]["user_draws"] != saved[1]["user_draws"]
