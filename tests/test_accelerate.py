"""fastfeed through Hugging Face Accelerate: prepare() keeps fastfeed's loader in each mode, resume, fallbacks."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import _datasets
import fastfeed

accelerate = pytest.importorskip("accelerate")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("shard", "split", "iterable", "dispatch", "threads")


def torchrun(phase, out):
    """tests/_accelerate.py PHASE under torchrun, 2 ranks on the CPU; what each rank saw."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(TESTS_DIR, "_accelerate.py"), phase, str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, cwd=out,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"{phase}-rank{rank}.pt", weights_only=False) for rank in range(2)]


def same(a, b, columns=2):
    """Two lists of batches (index, random draw) are equal, in their first ``columns`` tensors."""
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in list(zip(p, q))[:columns]) for p, q in zip(a, b))


def indices(batches):
    return [b[0].flatten().tolist() for b in batches]


FASTFEED = "fastfeed.loader.DataLoader"


@pytest.mark.hang_limit(300)
def test_prepare_keeps_fastfeed_and_gives_accelerates_batches_in_every_mode(tmp_path):
    """Under torchrun (2 ranks): sampler sharding, split_batches, an iterable dataset, dispatch_batches and thread
    workers keep fastfeed's loader and its arguments, and each rank's batches over 2 epochs equal those of
    Accelerate's torch-based loader with the same seed."""
    for rank, seen in enumerate(torchrun("compare", tmp_path)):
        for name in SCENARIOS:
            ours, theirs = seen[name, "fastfeed"], seen[name, "torch"]
            assert ours["isinstance"] and ours["base"] == FASTFEED, (name, ours["base"])
            assert theirs["base"] == "torch.utils.data.dataloader.DataLoader", theirs["base"]
            assert ours["len"] == theirs["len"]
            for epoch in range(2):
                assert ours["epochs"][epoch], (name, rank)
                assert same(ours["epochs"][epoch], theirs["epochs"][epoch]), (name, rank, epoch,
                                                                               indices(ours["epochs"][epoch]),
                                                                               indices(theirs["epochs"][epoch]))
        assert seen["shard", "fastfeed"]["numa"] == "off"
        assert seen["threads", "fastfeed"]["worker_type"] == "thread"


@pytest.mark.hang_limit(300)
def test_resume_through_save_state_and_load_state(tmp_path):
    """save_state after 3 batches, then load_state in new processes: with skip_first_batches, fastfeed's batches
    equal Accelerate's torch loader's; with use_stateful_dataloader, fastfeed's state gives the uninterrupted
    run's batches exactly, the workers' random draws included (with num_workers=0 the samples draw from the
    global RNG, which Accelerate restores to where it was at save_state, after its read-ahead: indices only)."""
    saved, loaded = torchrun("save", tmp_path), torchrun("load", tmp_path)
    for rank in range(2):
        before, after = saved[rank], loaded[rank]
        for name in ("skip", "stateful", "stateful-nw0"):
            assert before[name, "fastfeed"]["base"] == after[name, "fastfeed"]["base"] == FASTFEED
            uninterrupted, resumed = before[name, "fastfeed"]["after"], after[name, "fastfeed"]["after"]
            assert same(uninterrupted, before[name, "torch"]["after"]), (name, rank)
            assert same(uninterrupted, resumed, columns=1), (name, rank, indices(uninterrupted), indices(resumed))
        # skip_first_batches rebuilds the loader: still fastfeed's, and batch for batch Accelerate's own resume
        # (whose workers draw from a new seed: so do torch's).
        assert after["skip", "fastfeed", "skipped"]["base"] == FASTFEED
        assert same(after["skip", "fastfeed"]["after"], after["skip", "torch"]["after"])
        assert same(before["stateful", "fastfeed"]["after"], after["stateful", "fastfeed"]["after"]), rank


@pytest.fixture
def accelerator():
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState, PartialState

    def make(**settings):
        return Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**settings))

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([i * i])


def test_state_is_taken_when_asked_not_at_every_batch(accelerator, monkeypatch):
    """Accelerate asks its base loader for state_dict() before every batch; fastfeed's workers are asked once,
    when save_state (here state_dict()) wants it, and the state is the one after the batches the user had."""
    from fastfeed._iterator import RingDataLoaderIter

    asked = []
    real = RingDataLoaderIter._worker_states
    monkeypatch.setattr(RingDataLoaderIter, "_worker_states", lambda it, last: asked.append(1) or real(it, last))
    dl = accelerator(use_stateful_dataloader=True).prepare(fastfeed.DataLoader(Squares(), batch_size=2,
                                                                               num_workers=2))  # fmt: skip
    it = iter(dl)
    got = [next(it).tolist() for _ in range(5)]
    assert not asked
    state = dl.state_dict()
    assert len(asked) == 1 and state["yielded"] == 5 and state["mid_epoch"]
    rest = [b.tolist() for b in it]
    again = accelerator(use_stateful_dataloader=True).prepare(fastfeed.DataLoader(Squares(), batch_size=2,
                                                                                  num_workers=2))  # fmt: skip
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest
    assert len(got) + len(rest) == 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_iterable_resumes_from_its_own_state_behind_accelerates_read_ahead(accelerator, num_workers):
    """An IterableDataset with state_dict() (Accelerate dispatches its batches, reading ahead): the state taken
    after 3 batches restores the dataset where the user was, not where Accelerate's read-ahead had taken it
    (with num_workers=0 the samples' random draws come from the global RNG, which is past the read-ahead)."""
    import _datasets as ds

    keys = ("index", "read", "worker") if num_workers == 0 else ("index", "read", "worker", "x", "py", "np")

    def prepared():
        loader = fastfeed.DataLoader(ds.StatefulIterable(n=23), batch_size=2, num_workers=num_workers)
        return accelerator(use_stateful_dataloader=True).prepare(loader)

    dl = prepared()
    it = iter(dl)
    for _ in range(3):
        next(it)
    state = dl.state_dict()
    rest = [{k: b[k].tolist() for k in keys} for b in it]
    again = prepared()
    again.load_state_dict(state)
    assert [{k: b[k].tolist() for k in keys} for b in again] == rest and rest


def test_a_stateful_mode_fastfeed_cannot_serve_warns_and_uses_accelerates_loader(accelerator):
    """use_stateful_dataloader over worker threads and an iterable (whose per-worker position cannot be saved): a
    warning that says why and what to change, and torchdata's StatefulDataLoader, as Accelerate would build;
    in_order=False keeps fastfeed without a warning (its state names the batches received out of order)."""
    pytest.importorskip("torchdata")
    prepare = accelerator(use_stateful_dataloader=True).prepare
    with pytest.warns(UserWarning, match="worker_type='process' to keep fastfeed"):
        dl = prepare(fastfeed.DataLoader(_datasets.ShardedIterable(8), batch_size=4, num_workers=1,
                                         worker_type="thread"))  # fmt: skip
    assert type(dl.base_dataloader).__name__ == "StatefulDataLoader"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dl = prepare(fastfeed.DataLoader(Squares(), batch_size=4, num_workers=1, in_order=False))
    assert isinstance(dl.base_dataloader, fastfeed.DataLoader)


def test_torch_loaders_are_left_to_accelerate(accelerator):
    """A torch loader prepared while fastfeed's patch is in place is Accelerate's as before."""
    fastfeed.DataLoader(Squares(), batch_size=4)  # installs the patch
    assert fastfeed.accelerate.installed()
    dl = accelerator().prepare(torch.utils.data.DataLoader(Squares(), batch_size=4))
    assert type(dl.base_dataloader) is torch.utils.data.DataLoader
    assert not isinstance(dl, fastfeed.DataLoader)


LATE_IMPORT = """
import torch, fastfeed
loader = fastfeed.DataLoader(torch.arange(10), batch_size=3, worker_type="thread", num_workers=1)
assert "accelerate" not in sys.modules
from accelerate import Accelerator
assert fastfeed.accelerate.installed()
dl = Accelerator(cpu=True).prepare(loader)
assert isinstance(dl.base_dataloader, fastfeed.DataLoader) and dl.base_dataloader.worker_type == "thread"
assert [b.tolist() for b in dl] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
fastfeed.accelerate.uninstall()
dl = Accelerator(cpu=True).prepare(fastfeed.DataLoader(torch.arange(10), batch_size=3))
assert type(dl.base_dataloader) is torch.utils.data.DataLoader
print("ok")
"""


def test_a_loader_made_before_accelerate_is_imported_is_kept_and_uninstall_restores(tmp_path):
    """fastfeed patches Accelerate when it is imported after the loader was made; uninstall() gives Accelerate's
    own behaviour back."""
    proc = subprocess.run([sys.executable, "-c", "import sys\n" + LATE_IMPORT], capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


TRAIN = """
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        return torch.tensor([i]), torch.rand(1)


accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
loader = accelerator.prepare(DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2))
seen = [b[0].flatten().tolist() + b[1].flatten().tolist() for b in loader]
# A file per rank: the two ranks' lines would interleave on torchrun's shared stdout.
with open(f"rank{accelerator.process_index}.txt", "w") as f:
    f.write(f"{type(loader.base_dataloader).__module__} {seen}")
accelerator.end_training()  # as Accelerate asks: the process group ends before the interpreter
"""


@pytest.mark.hang_limit(240)
def test_torchrun_fastfeed_run_makes_a_scripts_torch_loaders_fastfeed_through_accelerate(tmp_path):
    """`torchrun -m fastfeed run train.py`, where train.py builds torch's loader and prepares it (as the HF Trainer
    does): each rank iterates fastfeed's loader and sees the batches plain `torchrun train.py` gives."""
    (tmp_path / "train.py").write_text(TRAIN)

    def ranks(*how):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *how]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False, cwd=tmp_path,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = [(tmp_path / f"rank{rank}.txt").read_text().split(" ", 1) for rank in range(2)]
        for rank in range(2):
            (tmp_path / f"rank{rank}.txt").unlink()
        return proc.stderr, [(module, batches) for module, batches in seen]

    out, ours = ranks("-m", "fastfeed", "run", "train.py")
    _, theirs = ranks("train.py")
    assert [module for module, _ in ours] == ["fastfeed.loader"] * 2
    assert [module for module, _ in theirs] == ["torch.utils.data.dataloader"] * 2
    assert [seen for _, seen in ours] == [seen for _, seen in theirs]
    assert out.count("fastfeed run: 1 of 1 DataLoader(s) replaced") == 2
