"""Checkpoint/resume: state_dict() after batch k, load_state_dict() in a new process, same batches.

Each test runs a configuration uninterrupted (the reference), runs it again up to a
point and takes `loader.state_dict()`, saves it with torch.save, then continues in a
new process (forked from a fresh Python that only imported torch and the helpers: see
RESUMER) started from another global seed: that process builds the same
loader, loads the state (torch.load with weights_only=True) and must yield the rest of
the reference, bit for bit, with the training loop's own random draws between batches
(torch, random, numpy) unchanged too. Configurations are named for tests/_resume.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import _candidate
import _datasets as ds
import _resume
from _compare import assert_same

pytestmark = pytest.mark.fastfeed_only

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# The new processes resumes run in: forked, one per resume, from a Python that has imported torch and the test
# helpers and done nothing else (it never builds a loader), so that each resume, like a restarted job, starts with
# no state of the run that saved, but without paying a fresh interpreter's torch import (most of a test's time).
# It reads one resume per line (tests/_resume.py's arguments) and answers each with the child's exit code; a
# child's traceback goes to OUT.err.
RESUMER = """
import os, sys, traceback
import torch
import _resume
for line in sys.stdin:
    args = line.split()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            name, at_epoch, mid_epoch, state_path, out_path = args
            state = torch.load(state_path, weights_only=True)
            torch.save(_resume.resumed(name, int(at_epoch), mid_epoch == "1", state), out_path)
            code = 0
        except BaseException:
            with open(args[-1] + ".err", "w") as f:
                f.write(traceback.format_exc())
        sys.exit(code)  # a normal exit: fastfeed's and multiprocessing's exit handlers join the workers
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.fixture(scope="module")
def resumer():
    """The process that forks a new process per resume (RESUMER); stopped at the module's end."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", RESUMER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def resume_in_new_process(name, at_epoch, k, tmp_path, resumer):
    """Stop config `name` after batch k of epoch at_epoch (None: at its end), resume elsewhere, compare.

    Returns the state that was saved.
    """
    ref = _resume.reference(name)
    seen, state = _resume.stopped(name, at_epoch, k)
    assert_same(seen, ref[:at_epoch] + [ref[at_epoch][: len(seen[-1])]], "before the stop")
    state_path, out_path = tmp_path / "state.pt", tmp_path / "out.pt"
    torch.save(state, state_path)
    mid_epoch = k is not None
    args = [name, str(at_epoch), "1" if mid_epoch else "0", str(state_path), str(out_path)]
    resumer.stdin.write(" ".join(args) + "\n")
    resumer.stdin.flush()
    code = resumer.stdout.readline().strip()
    assert code == "0", f"the resume exited {code!r}:\n" + (open(f"{out_path}.err").read() if code else "")
    got = torch.load(out_path, weights_only=False)
    expected = ([ref[at_epoch][k:]] if mid_epoch else []) + ref[at_epoch + 1 :]
    assert sum(map(len, expected)) > 0, "the case resumes nothing; it proves nothing"
    assert_same(got, expected, "after the resume")
    return state


def test_map_shuffled_single_process_mid_epoch(tmp_path, resumer):
    """Single-process, shuffled (global RNG): resuming after batch 2 of epoch 1 continues exactly."""
    resume_in_new_process("map:shuffle=1", 1, 2, tmp_path, resumer)


def test_map_generator_single_process_mid_epoch(tmp_path, resumer):
    """Single-process, shuffled by an explicit generator: resuming mid-epoch continues exactly."""
    resume_in_new_process("map:shuffle=1,generator=1", 1, 3, tmp_path, resumer)


def test_map_single_process_epoch_boundary(tmp_path, resumer):
    """Single-process: a state taken after epoch 0 ended starts epoch 1 as the uninterrupted run did."""
    resume_in_new_process("map:shuffle=1", 0, None, tmp_path, resumer)


def test_map_shuffled_workers_mid_epoch(tmp_path, resumer):
    """Two workers, shuffled (global RNG): per-worker RNG streams and order continue exactly mid-epoch."""
    resume_in_new_process("map:shuffle=1,nw=2", 1, 2, tmp_path, resumer)


def test_map_generator_workers_mid_epoch(tmp_path, resumer):
    """Two workers, explicit generator: base seed, order and worker streams continue exactly."""
    resume_in_new_process("map:shuffle=1,nw=2,generator=1", 1, 3, tmp_path, resumer)


def test_map_workers_epoch_boundary(tmp_path, resumer):
    """Two workers: a state taken after epoch 0 ended gives epochs 1 and 2 as uninterrupted."""
    state = resume_in_new_process("map:shuffle=1,nw=2", 0, None, tmp_path, resumer)
    assert state["mid_epoch"] is False and state["workers"] is None


def test_map_workers_odd_batch_count(tmp_path, resumer):
    """Resuming when the next batch belongs to worker 1 keeps the round robin in step."""
    state = resume_in_new_process("map:shuffle=1,nw=2", 1, 3, tmp_path, resumer)
    assert state["next_worker"] == 1


def test_iterable_single_process_mid_epoch(tmp_path, resumer):
    """Single-process IterableDataset: fast-forwarded past the batches seen, it continues exactly."""
    resume_in_new_process("iterable:", 1, 3, tmp_path, resumer)


def test_iterable_workers_mid_epoch(tmp_path, resumer):
    """Two workers over an IterableDataset: each replica resumes at its own position."""
    resume_in_new_process("iterable:nw=2", 1, 3, tmp_path, resumer)


def test_iterable_workers_near_the_end(tmp_path, resumer):
    """Two workers over an IterableDataset, resumed one batch before both replicas end."""
    resume_in_new_process("iterable:nw=2", 1, 5, tmp_path, resumer)


def test_iterable_worker_ended_before_the_state(tmp_path, resumer):
    """A worker whose replica ended (and exited) before the state stays out of the resumed epoch."""
    state = resume_in_new_process("uneven:nw=2,bs=2", 1, 6, tmp_path, resumer)
    assert state["workers"][1] is None


def test_persistent_iterable_worker_ended_before_the_state(tmp_path, resumer):
    """Persistent workers: a replica that ended before the state is idle, then runs the next epochs."""
    state = resume_in_new_process("uneven:nw=2,bs=2,persistent=1", 1, 6, tmp_path, resumer)
    assert state["workers"][1]["state"]["ended"] is True


def test_persistent_workers_mid_epoch(tmp_path, resumer):
    """Persistent workers: resumed mid-epoch 1, epoch 2 continues each worker's stream as torch's would."""
    resume_in_new_process("map:shuffle=1,nw=2,persistent=1", 1, 2, tmp_path, resumer)


def test_persistent_workers_epoch_boundary(tmp_path, resumer):
    """Persistent workers: a state after epoch 1 ended restarts the workers where their streams were."""
    state = resume_in_new_process("map:shuffle=1,nw=2,persistent=1", 1, None, tmp_path, resumer)
    assert state["mid_epoch"] is False and len(state["workers"]) == 2


def test_persistent_iterable_mid_epoch(tmp_path, resumer):
    """Persistent workers over an IterableDataset: resumed mid-epoch, later epochs match too."""
    resume_in_new_process("iterable:nw=2,persistent=1", 1, 5, tmp_path, resumer)


def test_distributed_sampler_workers(tmp_path, resumer):
    """DistributedSampler (2 replicas, rank 0, set_epoch each epoch) with two workers resumes exactly."""
    resume_in_new_process("distributed:nw=2", 1, 1, tmp_path, resumer)


def test_distributed_sampler_single_process(tmp_path, resumer):
    """DistributedSampler (2 replicas, rank 0, set_epoch each epoch) without workers resumes exactly."""
    resume_in_new_process("distributed:", 1, 2, tmp_path, resumer)


def test_stateful_iterable_single_process(tmp_path, resumer):
    """Single-process: an IterableDataset's own state_dict() is saved and loaded instead of replaying it."""
    state = resume_in_new_process("stateful:", 1, 3, tmp_path, resumer)
    assert state["dataset"] == {"pos": 12, "read": 12}


def test_stateful_iterable_workers(tmp_path, resumer):
    """Two workers: each worker's dataset state after its last batch seen is saved and restored in it."""
    state = resume_in_new_process("stateful:nw=2", 1, 3, tmp_path, resumer)
    assert [w["state"]["dataset"] for w in state["workers"]] == [{"pos": 16, "read": 8}, {"pos": 9, "read": 4}]


def test_stateful_iterable_persistent_workers(tmp_path, resumer):
    """Persistent workers over a stateful IterableDataset resume mid-epoch and run later epochs alike."""
    resume_in_new_process("stateful:nw=2,persistent=1", 1, 3, tmp_path, resumer)


def test_out_of_order_resumes_every_batch_not_received_once():
    """With in_order=False the state names the batches received (the first k and those past them): a new loader
    makes the others, each once, and the next epoch whole."""
    loader = _candidate.DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=2, in_order=False)
    it = iter(loader)
    seen = [x for _ in range(5) for x in next(it)["index"].tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    again = _candidate.DataLoader(ds.PlainDataset(40), batch_size=2, num_workers=2, in_order=False)
    again.load_state_dict(state)
    rest = [x for b in again for x in b["index"].tolist()]
    assert sorted(seen + rest) == list(range(40))
    assert sorted(x for b in again for x in b["index"].tolist()) == list(range(40))


END_OF_EPOCH = """
import torch, fastfeed
from _datasets import PlainDataset
loader = fastfeed.DataLoader(PlainDataset(6), batch_size=2, num_workers=2)
it = iter(loader)
for _ in range(3):
    next(it)
state = loader.state_dict()  # after the last batch, before the loop learns that the epoch ended
del it
for _ in range(5):
    again = fastfeed.DataLoader(PlainDataset(6), batch_size=2, num_workers=2)
    again.load_state_dict(state)
    assert list(again) == []  # nothing left: the epoch ends at once, while the second worker may still start
    del again
"""


def test_a_resumed_epoch_with_nothing_left_ends_quietly():
    """A state taken after the epoch's last batch: the resumed epoch ends at once, its ring unlinked, possibly
    before the second worker has started. That worker finds no ring and exits without a word (it printed a
    FileNotFoundError traceback from Control.attach in about 3 runs of 4)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [TESTS_DIR, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", END_OF_EPOCH], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_fresh_loader_state_restarts_from_the_first_epoch():
    """A state taken before any iteration makes a fresh loader run epoch 0 as the original would."""
    _resume.seed_all(_resume.SEED)
    loader, _ = _resume.build("map:shuffle=1,nw=2")
    state = loader.state_dict()
    ref = _resume.epoch(loader, None, 0)[0]
    _resume.seed_all(_resume.OTHER_SEED)
    other, _ = _resume.build("map:shuffle=1,nw=2")
    other.load_state_dict(state)
    assert_same(_resume.epoch(other, None, 0)[0], ref)


def test_worker_rng_snapshot_round_trips():
    """A worker's fast RNG snapshot restores torch, random and numpy exactly, cached gaussians included."""
    import random

    import numpy as np

    from fastfeed import _state

    _resume.seed_all(5)
    np.random.normal()  # leaves a cached gaussian in numpy's legacy state
    random.gauss(0, 1)  # and in random's gauss_next
    snap = _state.rngs_to_plain(_state.snapshot())

    def draws():
        return (torch.rand(3), random.gauss(0, 1), random.random(), np.random.normal(size=3), np.random.rand())

    first = draws()
    _state.restore_rngs(snap)
    second = draws()
    assert torch.equal(first[0], second[0]) and first[1:3] == second[1:3]
    assert (first[3] == second[3]).all() and first[4] == second[4]
