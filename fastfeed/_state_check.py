"""Checks of a saved state before anything is taken from it: one function per kind of state.

A state comes back from a checkpoint: a file that may be truncated, edited, of another version or written by
someone who means harm. Each ``check_*`` here reads the whole state first and raises a ``ValueError`` that names
the field, its value and what was expected (``state['workers'][1]['state']['batches'] is -3; expected a count >=
0``) before the loader, the dataset or an RNG is touched; so no count is used to build a list, no position runs a
loop past the data, and no value reaches an RNG, numpy or a C conversion that would answer with a MemoryError, an
OverflowError or a bare KeyError/TypeError.

What a state holds on behalf of someone else (a stateful sampler's or dataset's own ``state_dict()``) is passed to
that object's ``load_state_dict``, which alone knows its layout; here it is only checked to be shallow enough to
copy.
"""

from __future__ import annotations

import base64
import binascii
import inspect
import random
import reprlib
import sys

import torch

# The largest count a state may hold: a Python int that every conversion below (itertools.islice, range, numpy,
# C's int64) takes without an OverflowError. No epoch comes near it.
COUNT_MAX = sys.maxsize
# Worker states a loader state may hold: the length of a list the state itself carries, bounded so that a count
# in it builds nothing large. Far above the processes, threads and Ray actors one loader runs.
MAX_WORKERS = 4096
# How deep the parts a state holds for others (a sampler's or dataset's own state) may nest: the state is
# deep-copied, and a copy of a structure nested thousands deep ends in a RecursionError.
MAX_DEPTH = 100
# Asks of the sampler a saving loader may have made past the batches received: prefetch_factor per worker (this
# many at most, or the loader's own if larger) for the tasks in flight, plus this many for batches held back by a
# device stage or a wrapper reading ahead, and the ask that ended the sampler.
IN_FLIGHT_PER_WORKER = 64
IN_FLIGHT_SLACK = 4096
# Keys a training stack adds to the loader's state it saves (Accelerate tags it with _iterator_finished).
WRAPPER_KEYS = frozenset({"_iterator_finished"})

_MT_WORDS = 624  # a Mersenne Twister's state: 624 32-bit words and a position
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def show(value) -> str:
    """``repr(value)``, bounded: a damaged state may hold a 100 MB string or a list nested 100,000 deep."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return _REPR.repr(value)


def at(where: str, key) -> str:
    """The name of ``where``'s item ``key``: ``state['workers'][1]``."""
    return f"{where}[{key!r}]"


class Checker:
    """Raises the ValueErrors of one ``load_state_dict``: ``what`` names the method (and the state, where it is
    not the argument itself)."""

    def __init__(self, what: str):
        self.what = what

    def fail(self, where: str, value, expected: str):
        raise ValueError(f"{self.what}: {where} is {show(value)}; expected {expected}")

    def say(self, message: str):
        raise ValueError(f"{self.what}: {message}")

    def dict(self, value, where: str, required=(), optional=(), about: str = "") -> dict:
        """``value``, a dict with every key of ``required`` and no key outside ``required`` and ``optional``."""
        if not isinstance(value, dict):
            self.fail(where, value, f"a dict{about}")
        missing = [k for k in required if k not in value]
        if missing:
            self.say(f"{where} lacks the key(s) {missing}{about}: it is truncated, or from another version")
        known = set(required) | set(optional)
        unknown = sorted((k for k in value if k not in known), key=str)
        if unknown:
            self.say(f"{where} has the key(s) {show(unknown)}, which it does not hold{about} (its keys are "
                     f"{sorted(known)}): it is from another version, or damaged")  # fmt: skip
        return value

    def count(self, value, where: str, at_most: int = COUNT_MAX, at_least: int = 0, why: str = "") -> int:
        """An int (not a bool) in ``[at_least, at_most]``; ``why`` says where ``at_most`` comes from."""
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, value, f"an int >= {at_least}" if at_least else "a count (an int >= 0)")
        if value < at_least:
            self.fail(where, value, f"an int >= {at_least}" if at_least else "a count >= 0")
        if value > at_most:
            self.fail(where, value, f"at most {at_most}{why}")
        return value

    def flag(self, value, where: str) -> bool:
        if not isinstance(value, bool):
            self.fail(where, value, "True or False")
        return value

    def seq(self, value, where: str, length: int | None = None, what: str = "a list") -> list | tuple:
        if not isinstance(value, (list, tuple)):
            self.fail(where, value, what)
        if length is not None and len(value) != length:
            self.fail(where, value, f"{what} of {length} items, not {len(value)}")
        return value

    def real(self, value, where: str) -> float:
        if not isinstance(value, float):
            self.fail(where, value, "a float")
        return value

    def shallow(self, value, where: str) -> None:
        """A part the state holds for someone else: anything that can be copied (nested at most ``MAX_DEPTH``)."""
        stack = [(value, 0)]
        seen = set()  # ids of the containers walked: a shared part is copied once, and walked once
        while stack:
            item, depth = stack.pop()
            if not isinstance(item, (dict, list, tuple, set, frozenset)) or id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                children = list(item.keys()) + list(item.values())
            elif isinstance(item, (list, tuple, set, frozenset)):
                children = item
            if depth >= MAX_DEPTH:
                self.say(f"{where} is nested more than {MAX_DEPTH} deep: a damaged state (copying it would "
                         "exhaust the stack)")  # fmt: skip
            stack.extend((child, depth + 1) for child in children)

    # -- RNG states -------------------------------------------------------------------------------------------

    def torch_rng(self, value, where: str, generator: torch.Generator | None) -> None:
        """A torch generator's state, as base64 (versions 2, 3) or a uint8 tensor (version 1), that ``generator``'s
        kind takes; None: the CPU default generator's (the global torch RNG)."""
        device = "cpu" if generator is None else generator.device
        size = (torch.get_rng_state() if generator is None else generator.get_state()).numel()
        if isinstance(value, str):
            if len(value) != 4 * -(-size // 3):
                self.fail(where, value, f"a torch RNG state: {size} bytes in base64 ({4 * -(-size // 3)} characters), "
                          f"not {len(value)} characters")  # fmt: skip
            try:
                raw = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                self.fail(where, value, "a torch RNG state in base64")
            value = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        elif not isinstance(value, torch.Tensor):
            self.fail(where, value, "a torch RNG state (a base64 string)")
        if value.dtype != torch.uint8 or value.dim() != 1 or value.numel() != size or value.device.type != "cpu":
            self.fail(where, value, f"a torch RNG state: {size} bytes (a 1-d uint8 tensor on the CPU)")
        try:  # torch knows which states its generators take: ask a throwaway one
            torch.Generator(device=device).set_state(value)
        except (RuntimeError, TypeError, ValueError) as e:
            self.fail(where, value, f"a torch RNG state that torch takes ({e})")

    def py_rng(self, value, where: str) -> None:
        """``random.getstate()``: ``[3, [624 words < 2**32 and a position <= 624], gauss float or None]``."""
        version, internal, gauss = self.seq(value, where, 3, "random.getstate()'s [version, state, gauss]")
        if isinstance(version, bool) or not isinstance(version, int) or version not in (2, 3):
            self.fail(at(where, 0), version, "random.getstate()'s version, 3")
        words = self.seq(internal, at(where, 1), _MT_WORDS + 1)
        for i, word in enumerate(words[:_MT_WORDS]):
            self.count(word, at(at(where, 1), i), 2**32 - 1)
        self.count(words[_MT_WORDS], at(at(where, 1), _MT_WORDS), _MT_WORDS, why=" (the Mersenne Twister's index)")
        if gauss is not None:
            self.real(gauss, at(where, 2))
        try:
            random.Random().setstate((int(version), tuple(words), gauss))
        except (TypeError, ValueError, OverflowError) as e:
            self.fail(where, value, f"a state random.setstate takes ({e})")

    def np_rng(self, value, where: str) -> None:
        """numpy's legacy RNG state: ``["MT19937", 624 uint32 keys (base64, or a tensor), pos, has_gauss,
        gauss]``."""
        name, keys, pos, has_gauss, gauss = self.seq(value, where, 5, "numpy's [name, keys, pos, has_gauss, gauss]")
        if not isinstance(name, str) or name != "MT19937":
            self.fail(at(where, 0), name, "'MT19937'")
        if isinstance(keys, str):
            if len(keys) != 4 * -(-_MT_WORDS * 4 // 3):
                self.fail(at(where, 1), keys, f"{_MT_WORDS} uint32 keys in base64")
            try:
                base64.b64decode(keys, validate=True)
            except (binascii.Error, ValueError):
                self.fail(at(where, 1), keys, f"{_MT_WORDS} uint32 keys in base64")
        elif isinstance(keys, torch.Tensor):  # version 1
            if keys.dim() != 1 or keys.numel() != _MT_WORDS or keys.dtype != torch.int64 or keys.device.type != "cpu":
                self.fail(at(where, 1), keys, f"{_MT_WORDS} keys (an int64 tensor)")
            if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) > 2**32 - 1):
                self.fail(at(where, 1), keys, "keys in [0, 2**32)")
        else:
            self.fail(at(where, 1), keys, f"{_MT_WORDS} uint32 keys in base64")
        # numpy takes any position and reads its keys at it: only 0..624 are inside them.
        self.count(pos, at(where, 2), _MT_WORDS, why=" (the Mersenne Twister's position)")
        if not isinstance(has_gauss, int) or has_gauss not in (0, 1):
            self.fail(at(where, 3), has_gauss, "0 or 1")
        self.real(gauss, at(where, 4))

    def rngs(self, value, where: str, keys: tuple, generator: torch.Generator | None, saved: bool) -> None:
        """A dict of RNG states (``rngs_to_plain``'s, encoded). ``saved``: each must be there, else all may be None
        (a worker's RNGs in a state translated from torchdata's, which saves none: left as seeded)."""
        rngs = self.dict(value, where, keys)
        held = [k for k in ("torch", "random", "numpy") if k in keys and rngs[k] is not None]
        if not held and not saved:
            return
        for name in ("torch", "random"):
            if name in keys and rngs[name] is None:
                self.fail(at(where, name), None, f"a saved RNG state, as {where}'s other RNGs are")
        self.torch_rng(rngs["torch"], at(where, "torch"), None)
        self.py_rng(rngs["random"], at(where, "random"))
        # numpy's is None where the saving process had not imported numpy: the loading one then leaves it.
        if rngs.get("numpy") is not None:
            self.np_rng(rngs["numpy"], at(where, "numpy"))
        if "generator" in keys:
            self.generator_rng(rngs["generator"], at(where, "generator"), generator)

    def generator_rng(self, value, where: str, generator: torch.Generator | None) -> None:
        """The loader's ``generator``'s state: there where the loader has one (the sampler's order draws from it),
        anything torch takes where it has none (then it is not restored)."""
        if value is None:
            if generator is not None:
                self.fail(where, None, "the state of this loader's generator (it has one, and the sampler draws "
                          "from it): the state was saved by a loader without generator=, or is damaged")  # fmt: skip
            return
        if generator is None:  # not restored, only decoded: any generator's state (a CPU one's, a CUDA one's)
            if isinstance(value, str):
                try:
                    valid = 0 < len(value) <= 1 << 16 and len(base64.b64decode(value, validate=True)) > 0
                except (binascii.Error, ValueError):
                    valid = False
                if valid:
                    return
            elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
                return
            self.fail(where, value, "a torch generator's state (in base64) or None")
        self.torch_rng(value, where, generator)


# -- DataLoader states ------------------------------------------------------------------------------------------

# The keys a state of each version holds at every point (version 1: the first states; 2: with the sampler's and
# dataset iterator's own states; 3: every key of _state.KEYS).
_V1 = ("version", "epochs", "rng", "mid_epoch", "yielded", "sampler_rng", "base_seed", "dataset", "next_worker",
       "workers")  # fmt: skip
_V2 = _V1 + ("sampler_state", "dataset_iter", "num_workers", "asked")
_MAIN_RNGS = ("torch", "random", "numpy", "generator")
_SAMPLER_RNGS = ("torch", "generator")
_WORKER_RNGS = ("torch", "random", "numpy")
_WORKER_V1 = _WORKER_RNGS + ("dataset", "batches", "ended")


def check_version(state: dict, versions: tuple, what: str, root: str = "state") -> int:
    """A fastfeed state's ``version``, one of ``versions``."""
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in versions:
        raise ValueError(f"{what}: unknown DataLoader state version {show(version)} ({at(root, 'version')}): this "
                         f"fastfeed reads versions {versions} (and torchdata StatefulDataLoader's states)")  # fmt: skip
    return version


def check_job(state: dict, what: str) -> None:
    """A job's state (``_state.for_job``): ``{"version", "world_size", "ranks": {"<rank>": <a rank's state>}}``."""
    c = Checker(what)
    c.dict(state, "state", ("version", "world_size", "ranks"), WRAPPER_KEYS, " (a job's state, keyed by rank)")
    for key in WRAPPER_KEYS & state.keys():
        c.shallow(state[key], at("state", key))
    world = c.count(state["world_size"], at("state", "world_size"), at_least=1)
    ranks = state["ranks"]
    if not isinstance(ranks, dict) or not ranks:
        c.fail(at("state", "ranks"), ranks, "a dict of each rank's state, {'<rank>': state}, not empty")
    for key, value in ranks.items():
        where = at(at("state", "ranks"), key)
        if not isinstance(key, str) or not key.isdecimal() or len(key) > 20 or int(key) >= world:
            c.fail(f"a key of {at('state', 'ranks')}", key, f"a rank below the world size {world}, as a string "
                   "('0', '1', ...)")  # fmt: skip
        if not isinstance(value, dict):
            c.fail(where, value, "a rank's loader state (a dict)")


def check_torchdata(state: dict, what: str) -> None:
    """The numbers of a torchdata state that its translation builds from, bounded before it builds anything: a
    list of the workers ``_num_workers`` names, and islices as long as the ``*_yielded`` counts. (The translation
    checks the layout itself, and names what it cannot read.)"""
    c = Checker(f"{what}: this torchdata StatefulDataLoader state")
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict):
        main, prefix = snapshot.get("_main_snapshot"), "state['_snapshot']['_main_snapshot']"
        for key in ("_snapshot_step", "_last_yielded_worker_id"):
            if key in snapshot:
                c.count(snapshot[key], at(at("state", "_snapshot"), key))
        if isinstance(main, dict) and "_num_workers" in main:  # (the translation names each worker's snapshot)
            c.count(main["_num_workers"], at(prefix, "_num_workers"), MAX_WORKERS, why=" workers")
    else:
        main, prefix = state, "state"
    if "_steps_since_snapshot" in state:
        c.count(state["_steps_since_snapshot"], at("state", "_steps_since_snapshot"))
    if not isinstance(main, dict):
        return
    for key in ("_sampler_iter_yielded", "_num_yielded"):
        if key in main:
            c.count(main[key], at(prefix, key))
    it, where = main.get("_sampler_iter_state"), at(prefix, "_sampler_iter_state")
    for _ in range(2):  # torchdata's BatchSampler iterator, and the sampler iterator inside it
        if not isinstance(it, dict):
            break
        for key in ("samples_yielded", "yielded"):
            if key in it:
                c.count(it[key], at(where, key))
        it, where = it.get("sampler_iter_state"), at(where, "sampler_iter_state")


# Where a fastfeed state translated from torchdata's (``_from_torchdata.translate``) took each field from.
TORCHDATA_NAMES = {
    "yielded": "_num_yielded / _snapshot_step", "asked": "_num_yielded / _snapshot_step",
    "sampler_state": "_index_sampler_state / _sampler_iter_state", "due": "_sampler_iter_state",
    "base_seed": "_base_seed", "dataset": "dataset_state", "dataset_iter": "fetcher_state",
    "num_workers": "_num_workers", "next_worker": "_last_yielded_worker_id", "workers": "_worker_snapshots",
}  # fmt: skip


def check_loader_state(state: dict, loader, what: str, versions: tuple = (1, 2, 3), translated: bool = False,
                       root: str = "state") -> None:  # fmt: skip
    """A ``DataLoader`` state (any of ``versions``; JSON's values, ``torch.load``'s, or version 1's tensors),
    checked against ``loader``, the one that loads it. ``translated``: made from a torchdata state, whose fields
    messages name too; ``root``: how messages name the state (a job's rank's: ``state['ranks']['0']``)."""
    from torch.utils.data import _DatasetKind

    from . import _state

    c = Checker(what)
    if translated:
        root = "the state translated from torchdata's, state"
    version = check_version(state, versions, what, root)
    required = {1: _V1, 2: _V2, 3: _state.KEYS}[version]
    c.dict(state, root, required, set(_state.KEYS) | WRAPPER_KEYS, f" (a version {version} state)")

    def n(key):  # the name of a top-level field, for the names of its parts
        return at(root, key)

    def s(key):  # the name of a top-level field (and of the torchdata field it came from)
        return at(root, key) + (f" (from torchdata's {TORCHDATA_NAMES[key]})" if translated and
                                key in TORCHDATA_NAMES else "")  # fmt: skip
    for key in WRAPPER_KEYS & state.keys():
        c.shallow(state[key], s(key))

    mid = c.flag(state["mid_epoch"], s("mid_epoch"))
    c.count(state["epochs"], s("epochs"), at_least=1 if mid else 0)
    generator = loader.generator
    c.rngs(state["rng"], s("rng"), _MAIN_RNGS, generator, saved=True)

    # Workers: how many, and each one's state.
    saved_nw = state.get("num_workers")
    if version >= 2 or saved_nw is not None:
        saved_nw = c.count(saved_nw, s("num_workers"))
    workers = state["workers"]
    if workers is not None:
        c.seq(workers, s("workers"), what="a list of the workers' states, or None")
        if len(workers) > MAX_WORKERS:
            c.fail(s("workers"), workers, f"at most {MAX_WORKERS} workers' states, not {len(workers)}")
        if saved_nw is None:  # version 1 said it only here
            saved_nw = len(workers)
        elif len(workers) != saved_nw:
            c.fail(s("workers"), workers, f"a state for each of the {saved_nw} workers of state['num_workers'], "
                   f"not {len(workers)}")  # fmt: skip
    nw = saved_nw or 0
    iterable = loader._dataset_kind == _DatasetKind.Iterable
    if workers is None and mid and nw > 0 and iterable and state.get("shards") is None:
        # An IterableDataset's position mid-epoch is each worker's own (worker threads cannot save one).
        c.fail(s("workers"), None, f"the states of the {nw} workers of state['num_workers']: an IterableDataset's "
               "position mid-epoch is each worker's")  # fmt: skip

    kind = loader._dataset_kind
    stateful_dataset = _state.is_stateful(loader.dataset)
    for key in ("dataset", "dataset_iter", "sampler_state", "shards"):
        if state.get(key) is not None:
            c.shallow(state[key], s(key))
    # A dataset whose position is the job's (fastfeed.io.Shards) keeps it in "shards", in its own format (its
    # load_state_dict checks it); no other dataset has one.
    shards = state.get("shards")
    global_position = loader._ff_dataset_hooks.position is not None
    if shards is not None and not global_position:
        c.fail(s("shards"), shards, f"None: it holds a fastfeed.io.Shards position, and this loader's dataset is a "
               f"{type(loader.dataset).__name__}")  # fmt: skip
    if global_position and version >= 3 and not isinstance(shards, dict):
        c.fail(s("shards"), shards, f"the position of this loader's {type(loader.dataset).__name__} (a dict)")

    # A state of the dataset's iterator exists only where iter(dataset) gave a stateful one: never for a map-style
    # dataset, nor where __iter__ is a generator function (a generator has no state to load).
    no_iter_state = kind == _DatasetKind.Map or (not stateful_dataset and _generator_iter(loader.dataset))
    if state.get("dataset_iter") is not None and no_iter_state:
        c.fail(s("dataset_iter"), state["dataset_iter"], f"None: iter() of this loader's "
               f"{type(loader.dataset).__name__} gives no iterator with a state to load")  # fmt: skip
    if state["dataset"] is not None and not stateful_dataset:
        c.fail(s("dataset"), state["dataset"], f"None: this loader's {type(loader.dataset).__name__} has no "
               "state_dict()/load_state_dict() to take a dataset's state (the state was saved with another dataset, "
               "or is damaged)")  # fmt: skip
    # A stateful dataset iterated in this process mid-epoch continues from its own state, which the state holds.
    own_position = stateful_dataset and version >= 2 and not global_position
    if own_position and mid and nw == 0 and state["dataset"] is None and state.get("dataset_iter") is None:
        c.fail(s("dataset"), None, f"the state of this loader's {type(loader.dataset).__name__} (it has "
               "state_dict()/load_state_dict(), and the epoch continues from its state)")  # fmt: skip

    # The epoch's position: batches received, asks of the sampler, those received out of order, the rest due.
    due = state.get("due")
    if due is not None:
        c.seq(due, s("due"), what="a list of the epoch's remaining batches (lists of indices), or None")
        sized = _length(loader.dataset)
        for b, batch in enumerate(due):
            c.seq(batch, at(n("due"), b), what="a batch's sample indices (a list)")
            if not batch:
                c.fail(at(n("due"), b), batch, "a batch's sample indices (not empty)")
            for i, index in enumerate(batch):
                c.count(index, at(at(n("due"), b), i), COUNT_MAX if sized is None else sized - 1,
                        why=f" (the dataset has {sized} samples)")  # fmt: skip
    limit, why = COUNT_MAX, ""
    if due is not None:
        limit, why = len(due), f" (the batches in state['due']: {len(due)})"
    elif kind == _DatasetKind.Map:
        batches = _length(loader._index_sampler)
        if batches is not None:
            limit, why = batches, f" (this loader's epoch has {batches} batches)"
    yielded = c.count(state["yielded"], s("yielded"), limit, why=why)
    ahead = c.seq(state.get("received_ahead") or (), s("received_ahead"))
    if len(ahead) > yielded:
        c.fail(s("received_ahead"), ahead, f"at most state['yielded'] = {yielded} batches")
    frontier = yielded - len(ahead)
    in_flight = max(nw, loader.num_workers, 1) * max(IN_FLIGHT_PER_WORKER, loader.prefetch_factor or 0)
    in_flight += IN_FLIGHT_SLACK
    # (Asks go on being counted after the sampler ended: each task sent then asks again, and is told it ended.)
    asked_max = min(COUNT_MAX, yielded + in_flight)
    asked = yielded
    if "asked" in state:
        asked = c.count(state["asked"], s("asked"), asked_max,
                        why=" (the batches received and those a loader has in flight)")  # fmt: skip
    previous = frontier
    for i, number in enumerate(ahead):
        c.count(number, at(n("received_ahead"), i), max(asked - 1, 0))
        if number <= previous:
            c.fail(at(n("received_ahead"), i), number, f"a batch number above {previous}, the first batch not "
                   "received and those listed before it (the list is sorted)")  # fmt: skip
        previous = number

    # What the order of the epoch's batches is replayed from.
    sampler = _state.sampler_of(loader)
    sampler_state = state.get("sampler_state")
    # A stateful sampler continues from its own state (a state translated from torchdata's saved between epochs
    # from an older snapshot holds none: the sampler starts the next epoch as it is, as torchdata's does).
    if (mid or not translated) and version >= 2 and due is None and sampler is not None and sampler_state is None:
        c.fail(s("sampler_state"), None, f"the state of this loader's {type(sampler).__name__} (it has "
               "state_dict()/load_state_dict(), and the epoch continues from its state)")  # fmt: skip
    sampler_rng = state["sampler_rng"]
    drawn = False
    if sampler_rng is not None:
        rngs = c.dict(sampler_rng, s("sampler_rng"), _SAMPLER_RNGS)
        drawn = rngs["torch"] is not None
        if drawn:
            c.torch_rng(rngs["torch"], at(n("sampler_rng"), "torch"), None)
            c.generator_rng(rngs["generator"], at(n("sampler_rng"), "generator"), generator)
        elif rngs["generator"] is not None:
            c.fail(at(n("sampler_rng"), "torch"), None, "the torch RNG state the sampler drew from (its generator's "
                   "is saved)")  # fmt: skip
    replayed = mid and due is None and (sampler is None or sampler_state is None) and shards is None
    if replayed and max(asked, yielded) > 0 and not drawn:
        c.fail(s("sampler_rng"), sampler_rng, f"the RNG states the sampler drew from: the epoch's first {asked} "
               "asks of it are replayed from them")  # fmt: skip

    base_seed = state["base_seed"]
    if base_seed is not None:
        c.count(base_seed, s("base_seed"), 2**63 - 1, why=" (torch draws a worker base seed below 2**63)")
    elif mid and nw > 0 and shards is None:
        c.fail(s("base_seed"), None, "the workers' base seed of the epoch (an int): each worker's random stream "
               "starts from it")  # fmt: skip

    c.count(state["next_worker"], s("next_worker"), max(nw - 1, 0), why=f" (the state has {nw} workers)")

    for w, entry in enumerate(workers or ()):
        where = at(n("workers"), w)
        if entry is None:  # a worker whose iterable ended mid-epoch, and that exited
            if not (mid and iterable):
                c.fail(where, None, "a worker's state: only an IterableDataset's workers end and exit, mid-epoch")
            continue
        c.dict(entry, where, ("state", "epoch_start"))
        wstate = entry["state"]
        keys = _WORKER_V1 if version == 1 else _WORKER_V1 + ("dataset_iter",)
        c.dict(wstate, at(where, "state"), keys, _WORKER_V1 + ("dataset_iter",))
        c.rngs({k: wstate[k] for k in _WORKER_RNGS}, at(where, "state"), _WORKER_RNGS, None, saved=False)
        c.rngs(entry["epoch_start"], at(where, "epoch_start"), _WORKER_RNGS, None, saved=False)
        for key in ("dataset", "dataset_iter"):
            if wstate.get(key) is not None:
                c.shallow(wstate[key], at(at(where, "state"), key))
        if wstate.get("dataset_iter") is not None and no_iter_state:
            c.fail(at(at(where, "state"), "dataset_iter"), wstate["dataset_iter"], f"None: iter() of this loader's "
                   f"{type(loader.dataset).__name__} gives no iterator with a state to load")  # fmt: skip
        if own_position and mid and wstate["dataset"] is None and wstate.get("dataset_iter") is None:
            c.fail(at(at(where, "state"), "dataset"), None, f"the state of this worker's copy of the "
                   f"{type(loader.dataset).__name__} (it has state_dict()/load_state_dict())")  # fmt: skip
        if wstate["dataset"] is not None and not stateful_dataset:
            c.fail(at(at(where, "state"), "dataset"), wstate["dataset"], f"None: this loader's "
                   f"{type(loader.dataset).__name__} has no state_dict()/load_state_dict()")  # fmt: skip
        # An IterableDataset's worker made at most the batches received (each it made was received), and a plain
        # one's reads that many again on resuming. (A map-style worker's count is only reported on.)
        replays = mid and iterable and due is None
        c.count(wstate["batches"], at(at(where, "state"), "batches"), yielded if replays else COUNT_MAX,
                why=" (state['yielded']: the batches received)")  # fmt: skip
        ended = c.flag(wstate["ended"], at(at(where, "state"), "ended"))
        if ended and mid and not iterable:
            c.fail(at(at(where, "state"), "ended"), True, "False: only an IterableDataset's workers end")


def _generator_iter(dataset) -> bool:
    """Whether ``iter(dataset)`` is a generator (``__iter__`` is a generator function), known without calling it."""
    return inspect.isgeneratorfunction(getattr(type(dataset), "__iter__", None))


def _length(obj) -> int | None:
    """``len(obj)``, or None where it has none (an iterable's sampler, a sampler without ``__len__``)."""
    try:
        n = len(obj)
    except (TypeError, NotImplementedError):
        return None
    return n if isinstance(n, int) and n >= 0 else None


# -- fastfeed.io.Shards positions -------------------------------------------------------------------------------

_SHARDS_V1 = ("format", "version", "epoch", "batch", "within", "worker", "global_batch", "world")
_SHARDS_V2 = _SHARDS_V1 + ("ahead", "rank", "order")


def check_shards_state(state, identity: dict, ranks: tuple, versions: tuple, orders: tuple, batches: int | None,
                       batch_size: int | None, what: str) -> None:
    """A ``fastfeed.io.Shards`` position (its ``state_dict()``, or the ``"shards"`` part of a loader's), for the
    dataset loading it: ``identity``, the fields its order depends on (fingerprint, seed, ...), each of which the
    state must hold alike; ``ranks``, its (rank, world); ``batches`` and ``batch_size``, the most batches a rank
    has in the epoch and their size, where known (else the global batch is checked when the iteration starts)."""
    from .io.shards.dataset import STATE_FORMAT

    c = Checker(what)
    if not isinstance(state, dict):
        c.say(f"not a Shards state ({type(state).__name__})")
    if not isinstance(state.get("format"), str) or state["format"] != STATE_FORMAT:
        c.fail("state['format']", state.get("format"), f"{STATE_FORMAT!r}: not a Shards state")
    version = state.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version not in versions:
        c.say(f"unknown state version {show(version)} (state['version']); this fastfeed reads versions {versions}")
    required = (_SHARDS_V1 if version == 1 else _SHARDS_V2) + tuple(identity)
    c.dict(state, "state", required, _SHARDS_V2 + tuple(identity), f" (a Shards state of version {version})")
    order = state.get("order")
    if version > 1 and (isinstance(order, bool) or not isinstance(order, int) or order not in orders):
        c.say(f"the position is in shard order {show(order)}, and this fastfeed makes orders {orders}")
    c.count(state["epoch"], "state['epoch']")
    world = c.count(state["world"], "state['world']", at_least=1)
    global_batch = c.count(state["global_batch"], "state['global_batch']", at_least=1)
    if global_batch % world:
        c.fail("state['global_batch']", global_batch, f"batch_size x world: a multiple of state['world'] = {world}")
    # With another global batch the position means other samples: the iteration's start says so, naming the
    # world sizes that keep it; until then the batch size to bound it by is the saved one.
    same = batch_size is not None and batch_size * ranks[1] == global_batch
    limit = batches if same and batches is not None else COUNT_MAX
    why = f" (the epoch has {batches} global batches)" if limit == batches else ""
    batch = c.count(state["batch"], "state['batch']", limit, why=why)
    size = batch_size if same else global_batch // world
    c.count(state["within"], "state['within']", size - 1, why=f" (samples of a batch of {size} already yielded)")
    worker = state["worker"]
    if worker is not None:
        w, nw = c.seq(worker, "state['worker']", 2, "[worker, num_workers]")
        nw = c.count(nw, "state['worker'][1]", MAX_WORKERS, at_least=1)
        c.count(w, "state['worker'][0]", nw - 1, why=f" (of {nw} workers)")
    ahead = c.seq(state.get("ahead") or (), "state['ahead']")
    previous = batch
    for i, number in enumerate(ahead):
        c.count(number, f"state['ahead'][{i}]", limit, why=why)
        if number <= previous:
            c.fail(f"state['ahead'][{i}]", number, f"a batch above {previous} (state['batch'] and those listed "
                   "before it: the list is sorted)")  # fmt: skip
        previous = number
    if state.get("rank") is not None:
        rank = c.count(state["rank"], "state['rank']", world - 1, why=f" (a rank of state['world'] = {world})")
        if (rank, world) != tuple(ranks):
            c.say(f"this position was saved with in_order=False by rank {rank} of {world}, and this is rank "
                  f"{ranks[0]} of {ranks[1]}. Batches delivered out of order are each rank's own, so it continues "
                  f"only on its own rank of a job of the same size: load each rank's own state "
                  f"(torch.distributed.checkpoint saves every rank's), or save with in_order=True to resume on "
                  f"another world size.")  # fmt: skip
    for name, value in identity.items():
        saved = state[name]
        if type(saved) is not type(value) or saved != value:
            c.say(f"the state was saved with {name}={show(saved)} and this dataset has {name}={show(value)}; the "
                  f"order depends on it, so the position would not be the same. Build Shards with the saved {name}.")


# -- DALILoader states ------------------------------------------------------------------------------------------

_DALI_KEYS = ("fastfeed_dali", "checkpoint", "epoch", "runs", "batch_size", "samples_per_shard", "shard",
              "last_batch")  # fmt: skip


def check_dali_state(state, version: int, what: str) -> None:
    """A ``DALILoader`` state (its ``state_dict()``), before its DALI checkpoint is handed to a new pipeline."""
    c = Checker(what)
    if not isinstance(state, dict) or type(state.get("fastfeed_dali")) is not int or state["fastfeed_dali"] != version:
        c.say(f"not a DALILoader state (it comes from DALILoader.state_dict(), version {version})")
    c.dict(state, "state", _DALI_KEYS, about=f" (a DALILoader state of version {version})")
    if not isinstance(state["checkpoint"], (str, bytes)):
        c.fail("state['checkpoint']", state["checkpoint"], "DALI's checkpoint (a string)")
    c.count(state["epoch"], "state['epoch']")
    c.count(state["runs"], "state['runs']")
    c.count(state["batch_size"], "state['batch_size']", at_least=1)
    c.count(state["samples_per_shard"], "state['samples_per_shard']", at_least=1)
    shard_id, shards = c.seq(state["shard"], "state['shard']", 2, "[shard_id, num_shards]")
    shards = c.count(shards, "state['shard'][1]", at_least=1)
    c.count(shard_id, "state['shard'][0]", shards - 1, why=f" (of {shards} shards)")
    if not isinstance(state["last_batch"], str):
        c.fail("state['last_batch']", state["last_batch"], "'partial', 'drop' or 'pad'")
