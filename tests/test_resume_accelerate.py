"""Checkpoint/resume of fastfeed's loader through Hugging Face Accelerate's save_state / load_state, one process.

With ``DataLoaderConfiguration(use_stateful_dataloader=True)``, ``Accelerator.save_state(dir)`` writes each
prepared loader's ``state_dict()`` (``dl_state_dict.bin``) next to the RNG states, and ``load_state(dir)`` gives it
to the loader prepared in the new run. Each scenario: an uninterrupted run over 2 epochs; a run that reads K batches,
calls ``save_state`` and stops; a fresh Accelerator with a fresh loader that calls ``load_state`` and reads to the end
of the next epoch. The resumed samples must be the uninterrupted run's from batch K+1 on, with fastfeed's loader as
with torchdata's ``StatefulDataLoader`` (the reference, run the same way). tests/test_accelerate.py covers 2 ranks
under torchrun; this file covers the single-process path and an IterableDataset with its own state.
"""

import pytest
import torch

import _datasets as ds
import fastfeed

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (bash scripts/setup.sh installs it)")

N, BATCH, EPOCHS, K = 22, 3, 2, 3  # 8 batches an epoch (the last of 1); save_state after batch 3 of epoch 0

pytestmark = pytest.mark.hang_limit(120)


def fresh_accelerate():
    """Forget the Accelerator singletons, as a new process would start without them."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(autouse=True)
def _reset_accelerate():
    fresh_accelerate()
    yield
    fresh_accelerate()


def prepared(kind, dataset, num_workers, **args):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    fresh_accelerate()
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    set_seed(0)
    args = dict(batch_size=BATCH, num_workers=num_workers, **args)
    if kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(dataset, **args)
    else:
        loader = fastfeed.DataLoader(dataset, **args)
    dl = accelerator.prepare(loader)
    if kind == "fastfeed":
        assert isinstance(dl.base_dataloader, fastfeed.DataLoader), type(dl.base_dataloader)
    return accelerator, dl


def samples(batch):
    """What a batch says about the samples in it: their indices (and, for a stateful dataset, the position each
    worker's copy had reached)."""
    if isinstance(batch, dict):
        return list(zip(batch["index"].tolist(), batch["read"].tolist()))
    return batch.tolist()


def save_then_load(kind, make_dataset, num_workers, where, **args):
    """(uninterrupted run's batches over 2 epochs, the saving run's batches, the resumed run's batches)."""
    _, dl = prepared(kind, make_dataset(), num_workers, **args)
    full = [samples(b) for _ in range(EPOCHS) for b in dl]

    accelerator, dl = prepared(kind, make_dataset(), num_workers, **args)
    saved = []
    for batch in dl:
        saved.append(samples(batch))
        if len(saved) == K:
            accelerator.save_state(str(where))
            break  # the job stops here
    del accelerator, dl

    accelerator, dl = prepared(kind, make_dataset(), num_workers, **args)
    accelerator.load_state(str(where))
    resumed = [samples(b) for b in dl]  # the rest of epoch 0
    resumed += [samples(b) for b in dl]  # epoch 1
    return full, saved, resumed


KINDS = ["fastfeed", "torchdata"]


def need(kind):
    if kind == "torchdata":
        pytest.importorskip("torchdata", reason="torchdata is the reference (bash scripts/setup.sh installs it)")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_save_state_load_state_resumes_a_shuffled_map_dataset_at_the_next_batch(tmp_path, kind, num_workers):
    """save_state after K batches, then load_state with a new Accelerator and loader: the rest of that epoch and
    all of the next are the uninterrupted run's."""
    need(kind)
    full, saved, resumed = save_then_load(kind, lambda: ds.IndexMap(N), num_workers, tmp_path / "state",
                                          shuffle=True)  # fmt: skip
    per_epoch = len(full) // EPOCHS
    assert sorted(sum(full[:per_epoch], [])) == list(range(N)) and full[:per_epoch] != full[per_epoch:]
    assert saved == full[:K]
    assert resumed == full[K:], (full, resumed)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_save_state_load_state_resumes_a_stateful_iterable_dataset_from_its_own_state(tmp_path, kind, num_workers):
    """An IterableDataset with state_dict()/load_state_dict() (each sample says how far its copy had read): the
    resumed run gives the uninterrupted run's samples, from states restored, not replayed, to the end of epoch 1."""
    need(kind)
    full, saved, resumed = save_then_load(kind, lambda: ds.StatefulIterable(n=N), num_workers, tmp_path / "state")
    assert saved == full[:K]
    assert resumed == full[K:], (full, resumed)
    assert sorted(i for batch in full[: len(full) // EPOCHS] for i, _ in batch) == list(range(N))


class EverySeventhSlow(ds.IndexMap):
    """Item i is i; every seventh takes 20 ms, so two workers finish batches out of order."""

    def __getitem__(self, i):
        if i % 7 == 0:
            import time

            time.sleep(0.02)
        return i


def test_save_state_load_state_out_of_order_resumes_every_sample_not_received_once(tmp_path):
    """in_order=False keeps fastfeed's loader under use_stateful_dataloader (torchdata's repeats samples there):
    save_state after K batches, load_state in a new run: the batches received and the resumed ones hold every
    sample of the epoch once, and the next epoch is whole. Accelerate reads one batch ahead of its user, so the
    state is the one as of the batches the user had."""
    full, saved, resumed = save_then_load("fastfeed", lambda: EverySeventhSlow(N * 3), 2, tmp_path / "state",
                                          shuffle=True, in_order=False)  # fmt: skip
    per_epoch = len(full) // EPOCHS
    assert len(saved) == K
    rest, following = resumed[: len(resumed) - per_epoch], resumed[len(resumed) - per_epoch:]
    assert sorted(sum(saved, []) + sum(rest, [])) == list(range(N * 3))
    assert sorted(sum(following, [])) == list(range(N * 3))
