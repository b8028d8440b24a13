"""Random-number-generator and dataset states, for ``DataLoader.state_dict()``.

Snapshots are taken often (workers take one after every task), so ``snapshot`` only
copies the states; ``rngs_to_plain`` turns one into plain Python and tensors when it is
asked for, and ``encode`` turns a whole loader state into what JSON holds (``decode``
takes it back, from JSON, ``torch.load`` or the tensor form of earlier versions).
"""

from __future__ import annotations

import array
import base64
import collections
import copy
import ctypes
import itertools
import random
import sys
import warnings

import torch

from . import _state_check


def is_stateful(obj) -> bool:
    """An object that saves and restores its own position (``state_dict()``/``load_state_dict()``), as torchdata's
    ``Stateful`` protocol has it."""
    return obj is not None and all(callable(getattr(obj, name, None)) for name in ("state_dict", "load_state_dict"))


def is_stateful_dataset(dataset) -> bool:
    """A dataset (map-style or iterable) whose own state we save and restore."""
    return is_stateful(dataset)


def dataset_positions(dataset, fetcher) -> tuple:
    """``(dataset's state, its iterator's state)``, copied, as torchdata saves them (None: not stateful).

    An iterable whose ``__iter__`` returns itself has only the iterator's: its state is loaded after ``__iter__``
    (which would start it over), a dataset's before.
    """
    it = getattr(fetcher, "dataset_iter", None)
    it_state = copy.deepcopy(it.state_dict()) if is_stateful(it) else None
    ds_state = copy.deepcopy(dataset.state_dict()) if it is not dataset and is_stateful(dataset) else None
    return ds_state, it_state


def restore_dataset(dataset, ds_state, it_state, new_fetcher):
    """A new fetcher (``iter(dataset)``) at the saved position: the dataset's state loaded before ``__iter__``, the
    iterator's after. Both get copies, so a ``load_state_dict`` that changes its argument spoils no saved state."""
    if ds_state is not None:
        dataset.load_state_dict(copy.deepcopy(ds_state))
    fetcher = new_fetcher()
    it = getattr(fetcher, "dataset_iter", None)
    if it_state is not None and is_stateful(it):
        it.load_state_dict(copy.deepcopy(it_state))
    return fetcher


def sampler_of(loader):
    """The stateful sampler whose ``state_dict()`` gives the epoch's position (the batch sampler's own, else the
    sampler's), or None: then the order is replayed from the RNGs it drew from."""
    index_sampler = loader._index_sampler
    if is_stateful(index_sampler):
        return index_sampler
    if loader._auto_collation and is_stateful(loader.sampler):
        return loader.sampler
    return None


class SamplerLog:
    """A stateful sampler's states after each of the last draws of an epoch, for a state ``behind`` yields."""

    def __init__(self, sampler, keep: int):
        self.sampler = sampler
        self.keep = keep
        self.states: dict[int, object] = {}
        self.draws = 0

    def start(self, state=None, draws: int = 0) -> None:
        """A new epoch (or a resumed one, ``draws`` in, from ``state``: the sampler's before then)."""
        self.states = {draws: copy.deepcopy(self.sampler.state_dict()) if state is None else state}
        self.draws = draws

    def drew(self, asked: int) -> None:
        """The sampler was asked once more: ``asked`` times this epoch now (``Drawn`` counts them)."""
        self.draws = asked
        self.states[self.draws] = copy.deepcopy(self.sampler.state_dict())
        self.states.pop(self.draws - self.keep, None)

    def after(self, draws: int):
        """Its state after ``draws`` draws of this epoch."""
        if draws not in self.states:
            raise RuntimeError(f"the sampler's state after {draws} draws is no longer held (has {sorted(self.states)})")
        return self.states[draws]


def resume_sampler(loader, state, may_be_done: bool):
    """Load a stateful sampler's saved state and return an iterator over the loader's batches from there.

    ``may_be_done``: the state was saved between epochs (or before a batch of an epoch was yielded). The sampler's
    next ``__iter__`` may then have nothing left to yield (it continues the finished epoch, as torchdata's
    ``StatefulDistributedSampler`` does), and the next epoch is a fresh ``__iter__``, as an uninterrupted run's is.
    """
    sampler = sampler_of(loader)
    sampler.load_state_dict(copy.deepcopy(state))
    it = iter(loader._index_sampler)
    if not may_be_done:
        return it
    try:
        first = next(it)
    except StopIteration:
        return iter(loader._index_sampler)
    return _chain(first, it)


class Drawn:
    """An epoch's sampler iterator, counting the indices asked of it (the last ask may have ended it).

    A sampler may draw from the RNGs at any ask (RandomSampler draws its next permutation as the last index of
    an epoch is taken). The loader's state holds the RNGs as they are when it is taken, after the asks made for
    tasks still in flight; a resumed epoch makes those asks again with the RNGs put back (``replay``), so that
    they draw nothing twice.

    Asks are numbered from the epoch's first (``start``: the number of the source's first, where a resumed
    sampler continues from its own state); ``last`` is the number of the index handed out last, which names its
    batch in the epoch whatever order batches are delivered in (``in_order=False``).
    """

    def __init__(self, source, start: int = 0, drop=(), on_draw=None):
        """``drop``: numbers of asks whose batches were delivered already (out of order): asked, not handed out.
        ``on_draw(asked)``: called after each ask of the source (a ``SamplerLog`` notes the sampler's state)."""
        self.source = source
        self.asked = start  # of the source, numbered in the epoch
        self.last = start - 1
        self.drop = drop
        self.on_draw = on_draw
        self.kept: collections.deque = collections.deque()  # (number, index) asked again on resuming, for tasks

    def __iter__(self):
        return self

    def __next__(self):
        if self.kept:
            self.last, index = self.kept.popleft()
            return index
        while True:
            number, index = self._ask()
            if number not in self.drop:
                self.last = number
                return index

    def _ask(self) -> tuple:
        """The source's next index and its number; an ask that ends the source counts too (see the class)."""
        number = self.asked
        self.asked += 1
        index = next(self.source)
        if self.on_draw is not None:
            self.on_draw(self.asked)
        return number, index

    def replay(self, skip: int, asked: int, fetch=None, drop=(), constant: bool = False) -> None:
        """Ask again up to number ``asked``: those numbered below ``skip`` are dropped (``fetch(index)`` each), and
        so are those in ``drop`` (batches delivered out of order); the rest are kept for the tasks they were
        taken for.

        ``constant``: the source gives the same index at every ask and never ends (an IterableDataset's sampler,
        torch's ``_InfiniteConstantSampler``): asks dropped unfetched are counted, not made, so that no count in
        a state costs time. A source (or ``fetch``) that ends before ``skip`` asks means the state says more
        batches were received than the epoch has: a ValueError naming ``state['yielded']``."""
        if constant and fetch is None and self.asked < skip:
            self.asked = skip
        while self.asked < max(skip, asked):
            try:
                number, index = self._ask()
            except StopIteration:
                if self.asked - 1 < skip:
                    _past_the_end(skip, self.asked - 1, "its sampler")
                break
            if number < skip:
                if fetch is not None:
                    try:
                        fetch(index)
                    except StopIteration:
                        _past_the_end(skip, number, "its dataset")
            elif number not in drop:
                self.kept.append((number, index))


def _past_the_end(skip: int, ended_at: int, what: str):
    raise ValueError(
        f"DataLoader: the state loaded says {skip} batches of this epoch were received before those it lists "
        f"(state['yielded'] less state['received_ahead']), and this epoch ends after {ended_at} ({what} ended): the "
        "state is damaged, or was saved with another dataset or sampler"
    )


def advance(frontier: int, ahead, delivered: int) -> tuple[int, frozenset]:
    """The batches delivered, as (frontier, those past it), after ``delivered`` more were delivered in order from
    ``frontier``, passing over those in ``ahead`` (delivered before)."""
    past = sorted(ahead)
    i = 0
    while True:
        if i < len(past) and past[i] == frontier:
            frontier, i = frontier + 1, i + 1
        elif delivered and i < len(past):
            step = min(delivered, past[i] - frontier)  # the run up to the next one delivered before
            frontier, delivered = frontier + step, delivered - step
        else:
            return frontier + delivered, frozenset(past[i:])


def _chain(first, rest):
    yield first
    yield from rest


def _numpy():
    return sys.modules.get("numpy")  # numpy's RNG matters only where numpy was imported


# random.getstate() and numpy.random.get_state() build tuples of 624 ints (9 and 32 us):
# too slow to take after every task. The same bytes are copied straight from the two
# generator objects instead (under 1 us), at offsets checked once against getstate().
_PY_OFFSET = 16  # _random.Random: PyObject_HEAD, then int index, uint32 state[624]
_MT_BYTES = 4 + 624 * 4
_NP_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


def _py_fast():
    inst = random._inst
    return ctypes.string_at(id(inst) + _PY_OFFSET, _MT_BYTES), inst.gauss_next


def _py_plain(fast) -> tuple:
    raw, gauss_next = fast
    key = array.array("I")
    key.frombytes(raw[4:])
    return (3, (*key, int.from_bytes(raw[:4], sys.byteorder)), gauss_next)


def _find_np_gauss_offset(rs) -> int | None:
    # RandomState holds its bitgen_t (5 pointers) followed by aug_bitgen_t {bitgen_t *, int has_gauss, double gauss}.
    base = id(rs)
    for offset in range(16, type(rs).__basicsize__ - 24, 8):
        if ctypes.c_void_p.from_address(base + offset).value == base + offset - 40:
            return offset
    return None


class _NumpyFast:
    def __init__(self, np):
        self.rs = np.random.mtrand._rand
        self.state_address = self.rs._bit_generator.ctypes.state_address
        self.gauss_offset = _find_np_gauss_offset(self.rs)

    def take(self):
        base = id(self.rs)
        return (
            ctypes.string_at(self.state_address, _NP_STATE_BYTES),
            ctypes.c_int.from_address(base + self.gauss_offset + 8).value,
            ctypes.c_double.from_address(base + self.gauss_offset + 16).value,
        )


def _np_plain(fast) -> tuple:
    import numpy as np

    raw, has_gauss, gauss = fast
    keys = np.frombuffer(raw[: 624 * 4], dtype=np.uint32).copy()
    pos = int.from_bytes(raw[624 * 4 :], sys.byteorder, signed=True)
    return ("MT19937", keys, pos, has_gauss, gauss)


def _same_np(a, b) -> bool:
    return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]


_fast = {}  # "random": bool, "numpy": _NumpyFast | None, decided on first use


def _fast_paths():
    if "random" not in _fast:
        try:
            _fast["random"] = _py_plain(_py_fast()) == random.getstate()
        except Exception:  # noqa: BLE001 - any surprise means: use getstate()
            _fast["random"] = False
    np = _numpy()
    if np is not None and "numpy" not in _fast:
        fast = None
        try:
            saved = np.random.get_state()
            candidate = _NumpyFast(np)
            if candidate.gauss_offset is not None:
                np.random.normal()  # caches a gaussian: the check covers has_gauss and gauss too
                if _same_np(_np_plain(candidate.take()), np.random.get_state()):
                    fast = candidate
            np.random.set_state(saved)
        except Exception:  # noqa: BLE001
            fast = None
        _fast["numpy"] = fast
    return _fast


def snapshot() -> tuple:
    """The process's global RNG states (torch, random, numpy), copied cheaply."""
    fast = _fast_paths()
    np = _numpy()
    py_state = ("fast", _py_fast()) if fast["random"] else random.getstate()
    if np is None:
        np_state = None
    elif fast.get("numpy") is not None and np.random.mtrand._rand is fast["numpy"].rs:
        np_state = ("fast", fast["numpy"].take())
    else:
        np_state = np.random.get_state()
    return torch.get_rng_state(), py_state, np_state


def rngs_to_plain(snap: tuple) -> dict:
    torch_state, py_state, np_state = snap
    if py_state[0] == "fast":
        py_state = _py_plain(py_state[1])
    if np_state is not None and np_state[0] == "fast":
        np_state = _np_plain(np_state[1])
    plain = {"torch": torch_state, "random": py_state, "numpy": None}
    if np_state is not None:
        name, keys, pos, has_gauss, gauss = np_state
        plain["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return plain


def restore_rngs(plain: dict) -> None:
    """Set the global RNGs to a state made by ``rngs_to_plain``. An RNG whose state is None is left as it is (a
    state translated from torchdata's, which saves none for workers)."""
    if plain["torch"] is not None:
        torch.set_rng_state(plain["torch"])
    if plain["random"] is not None:
        random.setstate(plain["random"])
    np = _numpy()
    if plain["numpy"] is not None:
        if np is None:
            import numpy as np
        name, keys, pos, has_gauss, gauss = plain["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def main_rngs(generator) -> dict:
    """The main process's RNG states: global ones plus the loader's generator."""
    plain = rngs_to_plain(snapshot())
    plain["generator"] = None if generator is None else generator.get_state()
    return plain


def restore_main_rngs(plain: dict, generator) -> None:
    restore_rngs(plain)
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


def sampler_rngs(generator) -> dict:
    """What a sampler draws from: the global torch RNG and the loader's generator."""
    return {"torch": torch.get_rng_state(), "generator": None if generator is None else generator.get_state()}


def restore_sampler_rngs(plain: dict, generator) -> None:
    torch.set_rng_state(plain["torch"])
    if generator is not None and plain["generator"] is not None:
        generator.set_state(plain["generator"])


# -- the loader's state as JSON holds it ---------------------------------------------------------------------------


def _bytes_out(t) -> str | None:
    return None if t is None else base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _bytes_in(v) -> torch.Tensor | None:
    if v is None or isinstance(v, torch.Tensor):  # a tensor: a state of version 1, or saved before encoding
        return v
    return torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8)


def _rngs_out(plain: dict | None) -> dict | None:
    if plain is None:
        return None
    out = dict(plain)
    out["torch"] = _bytes_out(plain["torch"])
    if "generator" in plain:
        out["generator"] = _bytes_out(plain["generator"])
    if plain.get("random") is not None:
        version, internal, gauss = plain["random"]
        out["random"] = [version, list(internal), gauss]
    if plain.get("numpy") is not None:
        name, keys, pos, has_gauss, gauss = plain["numpy"]
        keys = base64.b64encode(keys.numpy().astype("<u4").tobytes()).decode("ascii")
        out["numpy"] = [name, keys, pos, has_gauss, gauss]
    return out


def _rngs_in(coded: dict | None) -> dict | None:
    if coded is None:
        return None
    out = dict(coded)
    out["torch"] = _bytes_in(coded["torch"])
    if "generator" in coded:
        out["generator"] = _bytes_in(coded["generator"])
    if coded.get("random") is not None:
        version, internal, gauss = coded["random"]
        out["random"] = (int(version), tuple(internal), gauss)
    if coded.get("numpy") is not None:
        name, keys, pos, has_gauss, gauss = coded["numpy"]
        if isinstance(keys, str):
            import numpy as np

            keys = torch.from_numpy(np.frombuffer(base64.b64decode(keys), dtype="<u4").astype(np.int64))
        out["numpy"] = (name, keys, int(pos), int(has_gauss), float(gauss))
    return out


def _workers(workers, convert):
    if workers is None:
        return None
    return tuple(None if w is None else dict(w, state=convert(w["state"]), epoch_start=convert(w["epoch_start"]))
                 for w in workers)  # fmt: skip


VERSION = 3  # the loader state's version that encode() and _from_torchdata.translate() make

# A state has these keys at every point (a fresh loader, mid-epoch, between epochs, loaded): a checkpointer that
# loads into the live object's state_dict(), as torch.distributed.checkpoint does, finds each one in the saved state.
KEYS = ("version", "epochs", "rng", "mid_epoch", "yielded", "sampler_rng", "sampler_state", "base_seed", "dataset",
        "dataset_iter", "shards", "num_workers", "asked", "next_worker", "workers", "received_ahead", "due")
NO_SAMPLER_RNG = {"torch": None, "generator": None}  # not drawn yet: the same keys as a drawn one's


def encode(state: dict) -> dict:
    """A loader state with its RNG states as base64 strings and lists of ints: ``json.dumps`` takes it whole.

    Its structure is the same at every point: every key of ``KEYS``, the RNG dicts with their fixed keys, and the
    parts whose shape varies with the epoch's progress (the workers' states) in a tuple, which
    torch.distributed.checkpoint stores as one value, as it does a string or an int (it would flatten a dict or a
    list of dicts into keys of their own, which a fresh loader's state would then lack).
    """
    state = dict(state, rng=_rngs_out(state["rng"]), sampler_rng=_rngs_out(state.get("sampler_rng")) or NO_SAMPLER_RNG,
                 workers=_workers(state.get("workers"), _rngs_out),
                 received_ahead=[int(t) for t in state.get("received_ahead") or ()],
                 due=None if state.get("due") is None else [[int(i) for i in b] for b in state["due"]])  # fmt: skip
    return {key: state.get(key) for key in KEYS}


def decode(state: dict) -> dict:
    """``encode``'s inverse: tensors and tuples again, from JSON's lists or ``torch.load``'s values alike."""
    state = copy.deepcopy(state)  # what the loader keeps is its own: the caller's dict stays as it was
    sampler_rng = state.get("sampler_rng")
    if sampler_rng is not None and all(v is None for v in sampler_rng.values()):
        sampler_rng = None
    return dict(state, rng=_rngs_in(state["rng"]), sampler_rng=_rngs_in(sampler_rng),
                workers=_workers(state.get("workers"), _rngs_in),
                received_ahead=tuple(state.get("received_ahead") or ()), due=state.get("due"))  # fmt: skip


# -- a job of several ranks ---------------------------------------------------------------------------------------


def _job() -> tuple[int, int] | None:
    """``(rank, world size)`` in an initialised process group of several ranks, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def for_job(state: dict) -> dict:
    """The state ``state_dict()`` returns: in a job of several ranks, this rank's under its own key.

    torch.distributed.checkpoint writes a non-tensor value saved under the same key by several ranks once, and
    every rank reads that one back: each rank's position and RNGs would become one rank's. Under a key per rank,
    each reads its own (as torchtitan keys its loaders' states by data-parallel rank).
    """
    job = _job()
    if job is None:
        return state
    rank, world = job
    return {"version": state["version"], "world_size": world, "ranks": {str(rank): state}}


def own_of(state: dict, global_position: bool, sampler_position) -> dict:
    """This rank's state from what ``load_state_dict`` was given (a job's, or one process's).

    ``global_position``: the dataset's position is the job's, not the rank's (``fastfeed.io.Shards``), so a rank
    may continue from another rank's state, on another world size too (a checkpoint of 4 ranks loaded by 2).
    ``sampler_position(state)``: whether a state's position is its sampler's alone (a map-style dataset without
    state of its own), which a rank may take from another rank's state of a job of the same size: Lightning saves
    rank 0's loader state only, and every rank loads it.
    """
    if not isinstance(state, dict) or ("ranks" not in state and "world_size" not in state):
        return state
    _state_check.check_job(state, "DataLoader.load_state_dict")
    ranks = state["ranks"]
    job = _job()
    rank, world = job if job is not None else (0, 1)
    saved_world = state.get("world_size")
    own = ranks.get(str(rank))
    if own is not None and (saved_world == world or global_position):
        return own
    first = min(ranks, key=int)
    if global_position:
        return ranks[first]
    if saved_world == world and sampler_position(ranks[first]):
        warnings.warn(
            f"DataLoader.load_state_dict(): this state holds rank {first}'s position and not rank {rank}'s (a "
            f"checkpoint of one rank's state, as Lightning saves): this rank's sampler continues the epoch at the "
            f"same batch, with rank {first}'s random streams", stacklevel=3)  # fmt: skip
        return ranks[first]
    raise ValueError(
        f"DataLoader.load_state_dict(): this state was saved by a job of {saved_world} ranks (state['world_size']) "
        f"and holds the states "
        f"of ranks {sorted(ranks, key=int)}; this is rank {rank} of {world}. This loader's position is each rank's "
        f"own, for its world size: load each rank's own state in a job of the same size "
        f"(torch.distributed.checkpoint saves every rank's). Only fastfeed.io.Shards continues on another world "
        f"size."
    )
