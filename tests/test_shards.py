"""fastfeed.io.Shards: the split over ranks and workers, the order, and exact, elastic resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader

import _shards
from fastfeed import DataLoader
from fastfeed.io import ShardError, Shards

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
N = sum(_shards.UNEQUAL)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("shards")
    _shards.make(directory)
    return str(directory)


def shards(directory, **kw):
    kw.setdefault("decode", _shards.as_tensor)
    kw.setdefault("shuffle", True)
    kw.setdefault("seed", 5)
    kw.setdefault("shuffle_window", 3)
    return Shards(directory, **kw)


def rank_batches(directory, world, batch_size, *, epoch=0, loader=DataLoader, ds_kw=None, **loader_kw):
    """What each rank of ``world`` yields in ``epoch`` (ranks simulated by rank=/world_size=)."""
    out = []
    for rank in range(world):
        ds = shards(directory, rank=rank, world_size=world, **(ds_kw or {}))
        ds.set_epoch(epoch)
        dl = loader(ds, batch_size=batch_size, **loader_kw)
        batches = [b.tolist() for b in dl]
        assert len(batches) == len(dl) == -(-len(ds) // batch_size)
        assert sum(len(b) for b in batches) == len(ds)
        out.append(batches)
    return out


def test_every_rank_gets_the_same_number_of_full_batches_over_unequal_shards(shard_dir):
    """Over shards of 1 to 12 samples, 3 ranks get the same number of full batches and len() says it exactly."""
    per_rank = rank_batches(shard_dir, 3, 4, num_workers=2)
    assert {len(r) for r in per_rank} == {6}  # ceil(65 / 12)
    assert all(len(b) == 4 for r in per_rank for b in r)
    seen = _shards.interleave(per_rank)
    assert sorted(set(seen)) == list(range(N))  # every sample; the 7 past the end repeat the epoch's first ones
    assert seen[N:] == seen[:len(seen) - N]


def test_drop_last_drops_what_does_not_fill_a_global_batch(shard_dir):
    """drop_last=True (the loader's) gives floor(65 / 12) batches per rank, each sample at most once."""
    per_rank = rank_batches(shard_dir, 3, 4, num_workers=0, drop_last=True)
    seen = _shards.interleave(per_rank)
    assert len(seen) == 60 and len(set(seen)) == 60


@pytest.mark.parametrize("loader_kw", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "loader": TorchLoader}])
def test_one_rank_yields_each_sample_once_with_a_short_last_batch_as_torch_does(tmp_path, loader_kw):
    """One rank, no torch.distributed: 180 samples at batch 16 are 12 batches, the last of 4, each sample once:
    the batch sizes and len() of torch's loader over 180 items."""
    _shards.make(tmp_path, (40, 25, 35, 20, 30, 30))
    loader_kw = dict(loader_kw)
    loader = loader_kw.pop("loader", DataLoader)
    ds = Shards(str(tmp_path), decode=_shards.as_tensor, shuffle=True, shuffle_window=2,
                batch_size=16 if loader is TorchLoader else None)  # fmt: skip
    dl = loader(ds, batch_size=16, **loader_kw)
    batches = [b.tolist() for b in dl]
    torch_batches = list(TorchLoader(range(180), batch_size=16))
    assert [len(b) for b in batches] == [len(b) for b in torch_batches] == [16] * 11 + [4]
    assert len(dl) == len(torch_batches) == 12 and len(ds) == 180
    assert sorted(_shards.flat(batches)) == list(range(180))


def test_even_batches_pads_one_rank_when_asked_and_drop_last_drops_the_short_batch(tmp_path):
    """even_batches=True fills one rank's last batch with the epoch's first samples; drop_last=True drops it."""
    _shards.make(tmp_path, (40, 25, 35, 20, 30, 30))
    padded = _shards.flat(DataLoader(Shards(str(tmp_path), decode=_shards.as_tensor, even_batches=True),
                                     batch_size=16))  # fmt: skip
    assert len(padded) == 192 and padded[180:] == padded[:12]
    dropped = _shards.flat(DataLoader(Shards(str(tmp_path), decode=_shards.as_tensor), batch_size=16,
                                      drop_last=True))  # fmt: skip
    assert len(dropped) == 176 == len(set(dropped))
    with pytest.raises(TypeError, match="even_batches must be True, False or None"):
        Shards(str(tmp_path), even_batches="yes")


def test_several_ranks_are_padded_unless_even_batches_is_false(shard_dir):
    """3 ranks over 65 samples at batch 4: padded to 6 full batches each by default; even_batches=False deals
    every sample once, the rank holding the epoch's end a short last batch and the ranks after it one fewer."""
    padded = rank_batches(shard_dir, 3, 4, num_workers=0)
    assert [len(r) for r in padded] == [6, 6, 6] and all(len(b) == 4 for r in padded for b in r)
    uneven = rank_batches(shard_dir, 3, 4, num_workers=2, ds_kw={"even_batches": False})
    assert [[len(b) for b in r][-1:] for r in uneven] == [[4], [1], [4]]
    assert [len(r) for r in uneven] == [6, 6, 5]
    seen = _shards.flat([b for r in uneven for b in r])
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("world,batch_size,loader_kw", [
    (1, 12, {"num_workers": 0}),
    (2, 6, {"num_workers": 2}),
    (3, 4, {"num_workers": 2, "worker_type": "thread"}),
    (4, 3, {"num_workers": 1, "persistent_workers": True}),
    (6, 2, {"num_workers": 2, "loader": TorchLoader}),
])  # fmt: skip
def test_the_global_sequence_depends_on_neither_the_world_size_nor_the_workers(shard_dir, world, batch_size, loader_kw):
    """With the same global batch, any world size and any num_workers (process, thread, torch's loader) yield the
    same global sequence of samples (one rank: each once; several: padded with the epoch's first ones)."""
    reference = _shards.interleave(rank_batches(shard_dir, 1, 12, num_workers=0))
    assert len(reference) == N
    loader_kw = dict(loader_kw)
    loader = loader_kw.pop("loader", DataLoader)
    ds_kw = {"batch_size": batch_size} if loader is TorchLoader else None
    got = _shards.interleave(rank_batches(shard_dir, world, batch_size, loader=loader, ds_kw=ds_kw, **loader_kw))
    assert got[:N] == reference and got[N:] == reference[:len(got) - N]


def test_set_epoch_gives_each_epoch_its_own_order_and_the_same_one_again(shard_dir):
    """Epochs 0 and 1 differ, epoch 0 again is epoch 0, another seed is another order, shuffle=False is the source's."""
    e0, e1, again = (_shards.interleave(rank_batches(shard_dir, 1, 5, epoch=e)) for e in (0, 1, 0))
    assert e0 != e1 and e0 == again and sorted(e0[:N]) == sorted(e1[:N]) == list(range(N))
    other = _shards.interleave(rank_batches(shard_dir, 1, 5, ds_kw={"seed": 6}))
    assert other != e0
    plain = _shards.interleave(rank_batches(shard_dir, 1, 5, ds_kw={"shuffle": False}))
    assert plain[:N] == list(range(N))


def test_samples_mix_within_a_window_of_shards_only(shard_dir):
    """Each run of positions that a window covers holds the samples of exactly that window's shards."""
    ds = shards(shard_dir)
    epoch = ds._order(0)
    starts = ds.index.starts
    for w in range(len(epoch.window_start) - 1):
        a, b = epoch.window_start[w], epoch.window_start[w + 1]
        window_shards = set(epoch.shards[w * 3:(w + 1) * 3].tolist())
        shard_of = {int(torch.searchsorted(torch.tensor(starts), int(s), right=True)) - 1 for s in epoch.samples[a:b]}
        assert shard_of == window_shards
    assert epoch.samples.tolist() != sorted(epoch.samples.tolist())


def test_a_persistent_worker_follows_set_epoch(shard_dir):
    """With persistent_workers=True the workers' copies take each set_epoch, as a new worker would."""
    ds = shards(shard_dir, batch_size=None)
    dl = DataLoader(ds, batch_size=5, num_workers=2, persistent_workers=True)
    got = []
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        got.append([b.tolist() for b in dl])
    assert got == [rank_batches(shard_dir, 1, 5, epoch=e)[0] for e in (0, 1, 2)]


@pytest.mark.parametrize("loader_kw", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "worker_type": "thread"},
                                       {"num_workers": 2, "persistent_workers": True}])  # fmt: skip
def test_a_state_after_break_continues_the_epoch_exactly(shard_dir, loader_kw):
    """state_dict() after a break, through JSON, into a new loader: the rest of the epoch, then the next epoch."""
    reference = [rank_batches(shard_dir, 1, 4, epoch=e)[0] for e in (3, 4)]
    ds = shards(shard_dir)
    dl = DataLoader(ds, batch_size=4, **loader_kw)
    ds.set_epoch(3)
    before = []
    for batch in dl:
        before.append(batch.tolist())
        if len(before) == 7:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    ds2 = shards(shard_dir)
    dl2 = DataLoader(ds2, batch_size=4, **loader_kw)
    dl2.load_state_dict(state)
    rest = [b.tolist() for b in dl2]
    ds2.set_epoch(4)
    assert before + rest == reference[0]
    assert [b.tolist() for b in dl2] == reference[1]


def test_a_state_between_epochs_starts_the_next_one(shard_dir):
    """A state taken after an epoch ended starts a whole epoch (the one set_epoch then names)."""
    ds = shards(shard_dir)
    dl = DataLoader(ds, batch_size=4, num_workers=2)
    for _ in dl:
        pass
    state = dl.state_dict()
    ds2 = shards(shard_dir)
    dl2 = DataLoader(ds2, batch_size=4, num_workers=2)
    dl2.load_state_dict(state)
    ds2.set_epoch(1)
    assert [b.tolist() for b in dl2] == rank_batches(shard_dir, 1, 4, epoch=1)[0]


class Counting:
    """A decode that counts the samples it was given (num_workers=0: in this process)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return _shards.as_tensor(sample)


def test_resuming_reads_nothing_before_the_resume_point(shard_dir):
    """Resumed at batch 10 of 17, the dataset reads only the samples of batches 10 on (the last one short)."""
    ds = shards(shard_dir)
    dl = DataLoader(ds, batch_size=4)
    for i, _ in enumerate(dl):
        if i == 9:
            break
    state = dl.state_dict()
    counting = Counting()
    ds2 = shards(shard_dir, decode=counting)
    dl2 = DataLoader(ds2, batch_size=4)
    dl2.load_state_dict(state)
    rest = list(dl2)
    assert len(rest) == 7 and counting.calls == N - 10 * 4


def test_in_order_false_resumes_the_batches_not_received_once_with_any_num_workers(shard_dir):
    """With in_order=False the batches received are not the epoch's first ones: the position names them (the
    first batch not received and those received past it), and a new loader, with another num_workers too, makes
    each of the others once; a state between epochs is the next epoch's start."""
    dl = DataLoader(shards(shard_dir), batch_size=4, num_workers=2, in_order=False)
    it = iter(dl)
    seen = [x for _ in range(7) for x in next(it).tolist()]
    state = json.loads(json.dumps(dl.state_dict()))
    del it
    assert state["shards"]["batch"] + len(state["shards"]["ahead"]) == 7
    again = DataLoader(shards(shard_dir), batch_size=4, num_workers=3, in_order=False)
    again.load_state_dict(state)
    rest = _shards.flat(again)
    assert sorted(seen + rest) == list(range(N))
    assert len(_shards.flat(dl)) == N
    state = dl.state_dict()
    assert state["mid_epoch"] is False


def test_another_global_batch_raises_naming_the_world_sizes_that_keep_it(shard_dir):
    """Resuming a global batch of 8 (2 x 4) on 3 ranks of 4 raises, listing the sizes that divide 8."""
    ds = shards(shard_dir, rank=0, world_size=2)
    dl = DataLoader(ds, batch_size=4)
    next(iter(dl))
    state = dl.state_dict()
    dl3 = DataLoader(shards(shard_dir, rank=0, world_size=3), batch_size=4)
    dl3.load_state_dict(state)
    with pytest.raises(ValueError, match=r"global batch of 8.*1 \(batch_size=8\), 2 \(batch_size=4\), 4 \(batch_size=2\)"):
        iter(dl3)


def test_a_state_of_another_order_raises(shard_dir):
    """A state saved with another seed (or shuffle, window, shard set) is refused, naming what differs."""
    dl = DataLoader(shards(shard_dir), batch_size=4)
    next(iter(dl))
    state = dl.state_dict()
    with pytest.raises(ValueError, match="seed=5 and this dataset has seed=6"):
        DataLoader(shards(shard_dir, seed=6), batch_size=4).load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_loader_with_another_batch_size_raises_on_the_first_batch(shard_dir, num_workers):
    """Shards(batch_size=4) under torch's DataLoader(batch_size=5) raises a ValueError naming both."""
    it = iter(TorchLoader(shards(shard_dir, batch_size=4), batch_size=5, num_workers=num_workers))
    with pytest.raises(ValueError, match=r"batch_size=4\) is iterated by a DataLoader with batch_size=5"):
        next(it)
    if num_workers:
        it._shutdown_workers()  # the error's traceback holds the iterator: its workers go now, not at collection


def test_fastfeed_loader_with_another_batch_size_raises_at_iter(shard_dir):
    """Shards(batch_size=4) under fastfeed's DataLoader(batch_size=5) raises at iter()."""
    with pytest.raises(ValueError, match=r"batch_size=4\) is iterated by a DataLoader with batch_size=5"):
        iter(DataLoader(shards(shard_dir, batch_size=4), batch_size=5, num_workers=2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torchdata_stateful_loader_resumes_shards(shard_dir, num_workers):
    """torchdata's StatefulDataLoader saves Shards' own state (per worker) and resumes it exactly."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = shards(shard_dir, batch_size=4)
    reference = [b.tolist() for b in TorchLoader(ds, batch_size=4)]
    dl = StatefulDataLoader(ds, batch_size=4, num_workers=num_workers)
    got = []
    for batch in dl:
        got.append(batch.tolist())
        if len(got) == 6:
            break
    dl2 = StatefulDataLoader(shards(shard_dir, batch_size=4), batch_size=4, num_workers=num_workers)
    dl2.load_state_dict(dl.state_dict())
    assert got + [b.tolist() for b in dl2] == reference


def test_a_damaged_local_shard_raises_naming_it_and_the_sample_and_yields_nothing_partial(tmp_path):
    """A shard cut short after indexing: the samples before the cut arrive whole, then ShardError names the
    shard and the first sample it could not read."""
    paths = _shards.make(tmp_path, (4, 4), payload=3000)
    with open(paths[1], "r+b") as f:
        f.truncate(os.path.getsize(paths[1]) // 2)
    ds = Shards(str(tmp_path), decode=_shards.number)
    got = []
    with pytest.raises(ShardError) as caught:
        for sample in DataLoader(ds, batch_size=None, num_workers=1):
            got.append(sample)
    assert caught.value.shard == paths[1] and caught.value.key.startswith("s0000")
    assert got == [0, 1, 2, 3, 4, 5][:len(got)] and 4 <= len(got) < 8
    assert paths[1] in str(caught.value) and caught.value.key in str(caught.value)


def test_len_of_a_fastfeed_loader_is_known_before_iter(shard_dir):
    """fastfeed.DataLoader tells Shards its batch size when made: len() of both works before the first iter()."""
    ds = shards(shard_dir, rank=1, world_size=2)
    dl = DataLoader(ds, batch_size=4, num_workers=2)
    assert len(dl) == 9 and len(ds) == 36
    assert len(list(b.clone() for b in dl)) == 9


def test_batch_size_and_rank_must_make_sense(shard_dir):
    """Bad batch_size, shuffle_window or rank values raise, naming the argument."""
    with pytest.raises(ValueError, match="batch_size"):
        Shards(shard_dir, batch_size=0)
    with pytest.raises(ValueError, match="shuffle_window"):
        Shards(shard_dir, shuffle_window=0)
    with pytest.raises(ValueError, match="rank 3 of world size 2"):
        Shards(shard_dir, rank=3, world_size=2)
    with pytest.raises(TypeError, match="batch size"):
        len(Shards(shard_dir))
    with pytest.raises(TypeError, match="decode must be callable"):
        Shards(shard_dir, decode="jpg")


def test_a_shard_missing_from_the_index_beside_is_named_in_the_warning(tmp_path):
    """A list naming a shard that the index beside the shards does not list warns that the index lacks it (not
    that there is no index), then indexes them all and reads every sample."""
    import shutil

    paths = _shards.make(tmp_path / "set", (2, 3))
    extra = _shards.make(tmp_path / "more", (4,), index=False)[0]
    shutil.copy(extra, tmp_path / "set" / "shard-000002.tar")
    listed = paths + [str(tmp_path / "set" / "shard-000002.tar")]
    with pytest.warns(UserWarning, match=r"fastfeed-index.json does not list 1 of the 3 shards \(e.g. .*shard-000002"
                                         r".tar\).*reading all 3") as caught:  # fmt: skip
        ds = Shards(listed, decode=_shards.number, batch_size=3)
    assert not any("no fastfeed-index.json" in str(w.message) for w in caught)
    assert len(_shards.flat(DataLoader(ds, batch_size=3))) == 9


def test_the_default_cache_directory_must_be_this_users_own(monkeypatch, tmp_path):
    """The default cache directory under the temp directory is made 0700, and one that is not private (another
    owner, a link, open to others) is refused, naming it."""
    import tempfile

    from fastfeed.io.shards import dataset

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    path, made = dataset._default_cache_dir()
    assert made == path and os.stat(path).st_mode & 0o777 == 0o700
    assert dataset._default_cache_dir() == (path, None)  # there already: not this call's
    os.chmod(path, 0o755)
    with pytest.raises(PermissionError, match="not a private directory"):
        dataset._default_cache_dir()
    os.rmdir(path)
    os.symlink(tmp_path, path)
    with pytest.raises(PermissionError, match=path):
        dataset._default_cache_dir()


# -- torchrun, gloo ------------------------------------------------------------------------------------------


def torchrun(world: int, directory: str, out, *args, timeout: float = 120) -> list[dict]:
    """Run tests/_shards_ranks.py on ``world`` CPU ranks; each rank's JSON report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           os.path.join(TESTS_DIR, "_shards_ranks.py"), directory, "8", str(out), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(TESTS_DIR), os.environ.get("PYTHONPATH")])))  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = []
    for rank in range(world):
        with open(f"{out}.{rank}.json") as f:
            reports.append(json.load(f))
    return reports


def global_sequence(reports: list[dict], epoch: int = 0) -> list[int]:
    return _shards.interleave([r["epochs"][epoch] for r in reports])


@pytest.fixture(scope="module")
def three_ranks(shard_dir, tmp_path_factory):
    """One launch of 3 ranks for the two tests below: 2 epochs with 1 worker each, then epoch 0 again without
    workers (the report's "also")."""
    out = tmp_path_factory.mktemp("r3") / "r3"
    return torchrun(3, shard_dir, out, "--epochs", "2", "--workers", "1", "--also-workers", "0")


def test_torchrun_three_ranks_over_unequal_shards_get_equal_batches_and_finish(three_ranks):
    """3 gloo ranks, all-reducing at every batch, over unequal shards: equal len(), equal batch counts, no hang."""
    reports = three_ranks
    for epoch in (0, 1):
        assert len({len(r["epochs"][epoch]) for r in reports}) == 1
    assert {r["len"] for r in reports} == {len(reports[0]["epochs"][0])}


def test_torchrun_one_rank_yields_each_sample_once_and_three_ranks_stay_equal(shard_dir, tmp_path, three_ranks):
    """Under torchrun with gloo: one rank yields every sample once (a short last batch), while three ranks over
    the same shards (without workers) get the same number of full batches, padded."""
    one = torchrun(1, shard_dir, tmp_path / "r1", "--workers", "2")
    assert sorted(global_sequence(one)) == list(range(N)) and one[0]["samples"] == N
    assert [len(b) for b in one[0]["epochs"][0]] == [8] * (N // 8) + [N % 8]
    three = [dict(r, epochs=[r["also"]]) for r in three_ranks]  # the launch's epoch 0 again, num_workers=0
    lengths = [[len(b) for b in r["epochs"][0]] for r in three]
    assert lengths == [[2] * 11] * 3  # 3 ranks of 2: 11 global batches of 6 for 65 samples, the last padded
    assert sorted(set(global_sequence(three))) == list(range(N))


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_torchrun_elastic_resume_yields_the_uninterrupted_global_batches(shard_dir, tmp_path, before, after):
    """Checkpointed after 3 global batches on `before` ranks, resumed on `after`: together exactly the global
    batches of an uninterrupted run, and the next epoch as well."""
    reference = [_shards.interleave(rank_batches(shard_dir, 1, 8, epoch=e, ds_kw={"seed": 11, "even_batches": True}))
                 for e in (0, 1)]  # padded as several ranks are
    first = torchrun(before, shard_dir, tmp_path / "a", "--stop-after", "3")
    second = torchrun(after, shard_dir, tmp_path / "b", "--resume", f"{tmp_path / 'a'}.state.json", "--epochs", "2")
    assert global_sequence(first) + global_sequence(second) == reference[0]
    assert global_sequence(second, 1) == reference[1]


def test_concurrent_iterators_of_one_dataset_do_not_share_positions(shard_dir):
    """Two threads iterating one Shards object each get the whole epoch."""
    ds = shards(shard_dir, decode=_shards.number, batch_size=1)
    results = [None, None]

    def run(i):
        results[i] = list(ds)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] and sorted(results[0]) == list(range(N))


def test_what_the_loader_tells_the_dataset_reaches_a_persistent_worker_whole(shard_dir):
    """Everything fastfeed.DataLoader's set-up changes on the dataset lives in what ``_ff_worker_sync`` carries,
    so a field added there cannot miss persistent workers: a copy that applies the sync has the same set-up, and
    the set-up changes no attribute outside it."""
    import copy

    ds = shards(shard_dir, batch_size=None)
    ds.load_state_dict(json.loads(json.dumps(_mid_epoch_state(shard_dir))))
    before = {k: copy.copy(v) for k, v in vars(ds).items()}
    ds._ff_loader_setup(batch_size=5, drop_last=True, num_workers=2, prefetch_factor=3, epoch_starts=True)
    changed = {k for k, v in vars(ds).items() if k not in before or before[k] is not v and before[k] != v}
    assert changed <= {"_run", "_pending"}, changed
    worker = copy.deepcopy(shards(shard_dir, batch_size=None))
    worker._ff_worker_apply(ds._ff_worker_sync())
    assert worker._run == ds._run and worker.epoch == ds.epoch and ds._run.start is not None


def _mid_epoch_state(shard_dir) -> dict:
    dl = DataLoader(shards(shard_dir, batch_size=None), batch_size=5)
    it = iter(dl)
    next(it)
    return dl.state_dict()["shards"]
