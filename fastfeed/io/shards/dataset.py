"""``Shards``: an IterableDataset over WebDataset-format tar shards, local or in object storage.

Where each sample comes from is decided before anything is read: the epoch's order is a pure function of the
index, the seed and the epoch (``order``), dealt out in global batches of ``batch_size x world``. So every rank
has the same number of batches whatever the shard sizes, the split does not depend on ``num_workers`` (worker w of
n makes the rank's batches w, w+n, ..., which the loader's round robin yields in order), resuming is an index into
the order (no sample before the resume point is read), and the cache knows when each shard is needed next.

Remote shards are read whole into a cache on local disk (``cache.ShardCache``): one large sequential read per
shard, once per machine, with the next window's shards downloaded while this one is read. Local shards are read in
place. A sample is read from its shard by the byte range the index gives and parsed whole before it is yielded.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from ..._state import advance
from ..._state_check import check_shards_state
from .. import remote
from . import order, topology
from .errors import ShardError
from .tar import read_sample

STATE_FORMAT = "fastfeed-shards"
# 2: the position names the order it was saved in ("order"); version 1's positions are all in order.LEGACY.
STATE_VERSION = 2
STATE_VERSIONS = (1, 2)
DEFAULT_WINDOW = 8  # shards whose samples are shuffled together; also what must be local at once
INDEX_NAME = "fastfeed-index.json"
_LARGE_READ = 64 << 20  # a sample's read past which the file's size is asked first (a syscall the rest skip)
_EPOCHS_LOCK = threading.Lock()  # Shards._epochs, which thread workers reach together


class Start(NamedTuple):
    """Where an iteration of an epoch starts: a loaded position."""

    batch: int  # the rank's first batch not received (or, for a worker's own position, that worker's next)
    within: int  # samples of that batch yielded already
    worker: list | None  # [w, nw]: a worker's own position (torch's loader, torchdata's), which only it continues
    global_batch: int  # batch_size x world when it was saved: the same global batches need the same one
    world: int
    ahead: frozenset  # batches past ``batch`` received already (in_order=False): made no more
    order: int  # the order (order.ORDER, or order.LEGACY for positions saved before it) it was saved in


@dataclass
class _Run:
    """What fastfeed.DataLoader told the dataset in the main process, and where this epoch's iteration starts.
    A persistent worker's copy takes all of it at each epoch (``_ff_worker_sync``): one object, so that a field
    added here reaches the workers without a list to keep."""

    batch: int | None = None  # the loader's batch size
    drop_last: bool = False
    prefetch: int | None = None  # the loader's prefetch_factor, where fastfeed.DataLoader told it
    ranks: tuple | None = None  # (rank, world) as the main process saw them, for workers without the process group
    start: Start | None = None


class Shards(IterableDataset):
    """WebDataset tar shards as a dataset: shard-aware shuffles, equal batches on every rank, exact and elastic
    resume, and a bounded cache that evicts the shard needed farthest ahead.

    Args:
        source: shard paths or URLs (a list), a directory, a brace pattern (``shard-{000000..000099}.tar``), or any
            fsspec URL (``s3://bucket/prefix/``, ``https://host/shard-{0..9}.tar``).
        decode: called on each sample (a dict of ``{ext: bytes}`` plus ``"__key__"`` and ``"__url__"``) in the
            worker; its result is what the loader collates. None: the dict itself.
        shuffle: a new shard-aware order each epoch (``set_epoch``); False: the source's order.
        seed: the order's seed; the same on every rank.
        batch_size: samples per batch on each rank. ``fastfeed.DataLoader`` sets it from its own; with torch's
            ``DataLoader`` pass the loader's (a mismatch raises on the first batch).
        cache_dir: where remote shards are kept (default: a directory of this user's under the temp directory),
            and the copy of a remote index that this machine's readers share, so that a node reads it once.
        cache_bytes: the cache's bound, all processes of this machine together (None: unbounded). It must hold
            ``max(2 x shuffle_window, shuffle_window + predownload)`` of the largest shards: the window read, the
            window before it (workers behind may still read it) and the shards downloaded ahead.
        predownload: shards downloaded ahead of need (default: one window, ``shuffle_window``).
        shuffle_window: shards whose samples are shuffled together (default 8); they must fit the cache at once.
        drop_last: drop the epoch's last samples that do not fill a global batch on every rank
            (``DataLoader(drop_last=True)`` sets it).
        even_batches: what happens to the last global batch when it is not full and ``drop_last`` is False. True:
            it is filled with the epoch's first samples, as DistributedSampler pads, so every rank has the same
            number of full batches. False: each sample comes once; the rank holding the epoch's end gets a short
            last batch and ranks after it one batch fewer. None (default): True when several ranks run (a DDP
            loop must not wait at a collective for a rank with fewer batches), False on one (a short last batch,
            as torch's loader gives).
        index: a ``ShardIndex`` or the path/URL of a saved one; None: ``fastfeed-index.json`` beside the shards,
            else built by reading every shard once (``fastfeed.io.index_shards`` saves one to skip that).
        allow_outside_urls: read shards that a saved index names outside its own directory (``../``, an absolute
            path, ``file://``, another host). False (default): such an index is refused, since an index is data
            and must not send the reader elsewhere; pass True for an index you trust that names them on purpose.
        storage_options: passed to fsspec (s3fs's ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``).
        rank, world_size: this process's place; None: torch.distributed's, else torchrun's RANK and WORLD_SIZE.
        retries: further attempts at most after a request fails transiently: the listing, the index, the scan,
            size look-ups and downloads (a 5xx such as S3's 503 SlowDown, 408, 429, a reset or refused connection,
            a timeout); None (default): as many as ``retry_budget`` allows. Each retry waits a random time up to a
            bound doubling from 0.1 s to 5 s (full jitter), after the store's Retry-After when it sends one; a
            missing shard (404) or denied access (403) fails at once.
        retry_budget: seconds after a request's first failure during which it is retried; None (default): 120 s
            (``fastfeed.io.remote.DEFAULT_RETRY_BUDGET_S``), enough for a job's start-up storm; ``math.inf``: no
            limit. See "Starting a large job" in the Shards guide.
        timeout: seconds a request may send nothing before the attempt fails.
        cache_policy: ``"farthest"`` evicts the shard needed farthest ahead; ``"lru"`` the least recently used
            (for comparison: with data larger than the cache it downloads everything every epoch).
    """

    def __init__(self, source, *, decode=None, shuffle: bool = False, seed: int = 0, batch_size: int | None = None,
                 cache_dir=None, cache_bytes: int | None = None, predownload: int | None = None,
                 shuffle_window: int = DEFAULT_WINDOW, drop_last: bool = False,
                 even_batches: bool | None = None, index=None,
                 storage_options: dict | None = None, rank: int | None = None, world_size: int | None = None,
                 retries: int | None = None, retry_budget: float | None = None, timeout: float = 60.0,
                 cache_policy: str = "farthest", allow_outside_urls: bool = False) -> None:  # fmt: skip
        from .index import ShardIndex
        from .sources import resolve

        for name, value in (("batch_size", batch_size), ("predownload", predownload)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"fastfeed.io.Shards: {name} must be a non-negative int, got {value!r}")
        if batch_size == 0:
            raise ValueError("fastfeed.io.Shards: batch_size must be at least 1")
        if not isinstance(shuffle_window, int) or shuffle_window < 1:
            raise ValueError(f"fastfeed.io.Shards: shuffle_window must be an int >= 1 (shards), got {shuffle_window!r}")
        if even_batches is not None and not isinstance(even_batches, bool):
            raise TypeError(f"fastfeed.io.Shards: even_batches must be True, False or None (pad only with several "
                            f"ranks), got {even_batches!r}")  # fmt: skip
        if decode is not None and not callable(decode):
            raise TypeError(f"fastfeed.io.Shards: decode must be callable (a sample dict -> what to collate) or None, "
                            f"got {type(decode).__name__}")  # fmt: skip
        self.decode = decode
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.even_batches = even_batches
        self.shuffle_window = shuffle_window
        self.predownload = shuffle_window if predownload is None else predownload
        self.storage_options = dict(storage_options or {})
        self.epoch = 0
        self._rank, self._world = rank, world_size
        topology.ranks(rank, world_size, None)  # bad values fail here, not in a worker
        remote.check_retry_args(retries, retry_budget, "fastfeed.io.Shards")
        made = None  # the default cache directory, when this call made it
        try:
            if isinstance(index, ShardIndex):
                self.index = index
            else:
                urls = resolve(source, storage_options=self.storage_options, retries=retries,
                               retry_budget=retry_budget, timeout=timeout)  # fmt: skip
                shared = None  # where this machine's readers share a remote index's one read
                if any(map(remote.is_url, urls)) or (isinstance(index, str) and remote.is_url(index)):
                    if cache_dir is None:
                        cache_dir, made = _default_cache_dir()
                    shared = cache_dir
                self.index = _load_index(urls, index, self.storage_options, retries, timeout, retry_budget, shared,
                                         allow_outside_urls=allow_outside_urls)  # fmt: skip
            self.cache = None
            if any(remote.is_url(u) for u in self.index.urls):
                from .cache import ShardCache

                _check_cache_bytes(cache_bytes, self.shuffle_window, self.predownload, self.index.sizes)
                if cache_dir is None:
                    cache_dir, made = _default_cache_dir()
                self.cache = ShardCache.for_dataset(cache_dir, self.index.fingerprint, cache_bytes,
                                                    storage_options=self.storage_options, retries=retries,
                                                    retry_budget=retry_budget, timeout=timeout,
                                                    policy=cache_policy)  # fmt: skip
        except BaseException:
            if made is not None:  # a constructor that failed leaves nothing behind: the index's copy, the directory
                shutil.rmtree(os.path.join(made, "indexes"), ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rmdir(made)
            raise
        # Loader set-up and resume (see _ff_loader_setup, load_state_dict).
        self._run = _Run()  # what fastfeed.DataLoader told, and where this epoch's iteration starts
        self._pending = None  # a loaded position, for the next iteration of its epoch
        self._progress = {}  # worker id -> (batch under way, samples of it yielded), in this process
        self._epochs = OrderedDict()  # (epoch, order version) -> order.Epoch, the last two made in this process

    # -- what a user calls ---------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on (call it on every rank, before ``iter``)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Samples on this rank this epoch: ``batches x batch_size``, the same on every rank when batches are
        even (see ``even_batches``); else each sample once, the last batch short."""
        return self._split(self._batch_size(required=True)).samples

    def cache_stats(self) -> dict:
        """The cache's counters, all processes of this machine together (``downloaded_bytes``, ``downloads``,
        ``hits``, ``evictions``); empty for local shards."""
        return {} if self.cache is None else self.cache.stats()

    def state_dict(self) -> dict:
        """This process's position in the epoch: the batch under way and the samples of it already yielded.

        ``fastfeed.DataLoader.state_dict()`` keeps the rank's position instead (the batches the user received),
        which continues on another number of ranks. Inside a worker of torch's loader (torchdata's
        ``StatefulDataLoader`` asks there) it is that worker's, and continues with the same ``num_workers``.
        """
        w, nw = topology.worker()
        start = self._run.start
        batch, within = self._progress.get(w) or ((start.batch, start.within) if start is not None else (w, 0))
        if within == self._batch_size():
            batch, within = batch + nw, 0
        return self._state(batch, within, [w, nw] if nw > 1 else None)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (``state_dict()``'s, or the ``"shards"`` part of a loader's) at the next
        iteration of its epoch. The order's seed, shuffle and window must match, and so must the global batch
        ``batch_size x world`` (checked when the iteration starts: then the batch size is known)."""
        # Checked whole before anything is taken from it: a position from a damaged or hostile checkpoint ends in a
        # ValueError naming its field, never in a loop over a huge count or a bare KeyError (see _state_check).
        batch_size = self.batch_size or self._run.batch
        check_shards_state(state, self._identity(), self._ranks(), STATE_VERSIONS, order.ORDERS,
                           None if batch_size is None else self._split(batch_size, rank=0).batches, batch_size,
                           "fastfeed.io.Shards.load_state_dict")  # fmt: skip
        self.epoch = state["epoch"]
        self._pending = dict(state)

    # -- the loader's side (fastfeed.DataLoader calls these; torch's does not need them) --------------------

    def _ff_loader_setup(self, *, batch_size: int | None, drop_last: bool, num_workers: int,
                         prefetch_factor: int | None, epoch_starts: bool) -> None:  # fmt: skip
        """Called by fastfeed.DataLoader in the main process when it is made (so ``len()`` works at once) and at
        each ``iter()`` (``epoch_starts``), before workers get the dataset."""
        if batch_size is not None and self.batch_size is not None and batch_size != self.batch_size:
            raise ValueError(_mismatch(self.batch_size, batch_size))
        run = self._run
        run.batch, run.drop_last, run.prefetch = batch_size, bool(drop_last), prefetch_factor
        run.ranks = self._ranks()
        if epoch_starts:
            self._begin()

    def _ff_position(self, yielded: int | None, delivered: list | None = None) -> dict:
        """The rank's position after the user received ``yielded`` batches of this epoch (None: between epochs).

        ``delivered``: with ``in_order=False``, how many batches each worker delivered; worker w of n makes the
        w-th, (w+n)-th, ... of the batches still to make, and delivers its own in that order, so these counts say
        which batches were received. The position is then the first batch not received and those received past
        it, and it is this rank's alone: other ranks received others.
        """
        if yielded is None:
            return self._state(0, 0, None)
        start = self._run.start
        batch, within, ahead = (start.batch, start.within, start.ahead) if start else (0, 0, frozenset())
        if delivered is None:
            frontier, past = advance(batch, ahead, yielded)
            return self._state(frontier, 0 if yielded else within, None, past)
        n = len(delivered)
        got = set(ahead)
        still = (b for b in itertools.count(batch) if b not in ahead)
        for k, b in enumerate(itertools.islice(still, n * max(delivered, default=0))):
            if k // n < delivered[k % n]:
                got.add(b)
        frontier, past = advance(batch, got, 0)
        rank = self._ranks()[0]
        return self._state(frontier, within if frontier == batch and not past else 0, None, past, rank)

    def _ff_worker_sync(self) -> dict:
        """What a persistent worker's copy must take from this one at a new epoch."""
        return {"epoch": self.epoch, "run": replace(self._run)}

    def _ff_worker_apply(self, sync: dict) -> None:
        self.epoch, self._run, self._pending = sync["epoch"], sync["run"], None

    # -- iteration -----------------------------------------------------------------------------------------

    def _begin(self) -> None:
        """Take a loaded position for this epoch's iteration. The position is read when an iteration starts and
        cleared when one ends, so the next epoch starts afresh (a persistent worker's copy too)."""
        pending, self._pending = self._pending, None
        self._run.start = None
        if pending is not None and pending["epoch"] == self.epoch:
            self._check_global_batch(pending)
            ahead = frozenset(pending.get("ahead") or ())
            if pending["batch"] or pending["within"] or ahead:
                self._run.start = Start(pending["batch"], pending["within"], pending.get("worker"),
                                        pending["global_batch"], pending["world"], ahead,
                                        pending.get("order", order.LEGACY))  # fmt: skip

    def __iter__(self):
        if self._pending is not None:  # loaded, and not set up by fastfeed.DataLoader: the position starts here
            self._begin()
        return self._samples(self._run.start)

    def _samples(self, start: Start | None):
        w, nw = topology.worker()
        caller = _loader_batch_size(sys._getframe(1))
        batch_size = self._batch_size(caller)
        split = self._split(batch_size)
        if start is not None and self._run.batch is None and self.batch_size is None:
            self._check_global_batch({"global_batch": start.global_batch, "world": start.world}, batch_size)
        epoch = self._order(self.epoch, start.order if start is not None else order.ORDER)
        n = self.index.n_samples
        first = _first_batch(start, w, nw)
        within = start.within if start is not None and first == start.batch else 0
        batches = range(first, split.batches, nw)
        if start is not None and start.ahead:  # batches received out of order are made no more; the rest dealt out
            batches = itertools.islice((b for b in range(start.batch, split.batches) if b not in start.ahead), w,
                                       None, nw)  # fmt: skip
        reader = _Reader(self, epoch, split)
        progress = self._progress
        try:
            for batch in batches:
                positions = split.positions(batch)
                for t in range(within, len(positions)):
                    p = positions[t]
                    reader.at(p)  # per sample: a batch can cross into the next window, and protection follows p
                    sample = reader.sample(epoch.sample(p % n))
                    progress[w] = (batch, t + 1)
                    yield sample
                within = 0
        finally:
            reader.close()
            if self.cache is not None and get_worker_info() is None:
                self.cache.close()  # the main process's downloads and connections: remade if another epoch comes
        if self._run.start is start:  # the epoch is done: its next iteration starts it afresh
            self._run.start = None

    # -- helpers -------------------------------------------------------------------------------------------

    def _batch_size(self, caller: int | None = None, required: bool = False) -> int:
        if self.batch_size is not None:
            if caller is not None and caller != self.batch_size:
                raise ValueError(_mismatch(self.batch_size, caller))
            return self.batch_size
        if self._run.batch is not None:
            return self._run.batch
        if caller is not None:
            return caller
        if required:
            raise TypeError("len(fastfeed.io.Shards) needs its batch size: pass batch_size= to Shards (the "
                            "DataLoader's), or use fastfeed.DataLoader, which tells it")  # fmt: skip
        return 1

    def _split(self, batch_size: int, rank: int | None = None) -> order.Split:
        """This rank's split of the epoch (``rank``: another's; rank 0 has the most batches)."""
        own, world = self._ranks()
        rank = own if rank is None else rank
        drop_last = self.drop_last or self._run.drop_last
        pad = world > 1 if self.even_batches is None else self.even_batches
        return order.Split.of(self.index.n_samples, batch_size, rank, world, drop_last, pad)

    def _ranks(self) -> tuple[int, int]:
        return topology.ranks(self._rank, self._world, self._run.ranks)

    def _order(self, epoch: int, version: int = order.ORDER) -> order.Epoch:
        with _EPOCHS_LOCK:  # thread workers share this dataset: one Epoch per key, and its windows with it
            found = self._epochs.get((epoch, version))
            if found is None:
                found = self._epochs[epoch, version] = order.epoch_order(
                    self.index.counts, self.index.starts, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                    window=self.shuffle_window, version=version,
                )  # fmt: skip
                while len(self._epochs) > 2:
                    self._epochs.popitem(last=False)
            return found

    def _identity(self) -> dict:
        return {"fingerprint": self.index.fingerprint, "seed": self.seed, "shuffle": self.shuffle,
                "shuffle_window": self.shuffle_window}  # fmt: skip

    def _state(self, batch: int, within: int, worker, ahead=(), rank: int | None = None) -> dict:
        """``ahead``: batches past ``batch`` received already (in_order=False); ``rank``: the rank whose position it
        is alone (in_order=False), else None."""
        world = self._ranks()[1]
        batch_size = self._batch_size()
        start = self._run.start  # a resumed epoch's positions stay in the order it was saved in
        return {"format": STATE_FORMAT, "version": STATE_VERSION, **self._identity(), "epoch": self.epoch,
                "batch": int(batch), "within": int(within), "worker": worker,
                "global_batch": batch_size * world, "world": world, "ahead": sorted(int(b) for b in ahead),
                "rank": rank, "order": order.ORDER if start is None else start.order}  # fmt: skip

    def _check_global_batch(self, state: dict, batch_size: int | None = None) -> None:
        if batch_size is None:
            if self._run.batch is None and self.batch_size is None:
                return  # checked when the first batch's size is known
            batch_size = self._batch_size()
        rank, world = self._ranks()
        ours = batch_size * world
        saved = state["global_batch"]
        if ours != saved:
            # The first 16 world sizes up to 4096 that divide it: a global batch read from a checkpoint may be any
            # size, and listing all its divisors could take as long as counting to it.
            sizes = [f"{w} (batch_size={saved // w})" for w in range(1, min(saved, 4096) + 1) if saved % w == 0]
            sizes = ", ".join(sizes[:16]) + (", ..." if len(sizes) > 16 else "")
            raise ValueError(
                f"fastfeed.io.Shards: the state was saved with a global batch of {saved} samples "
                f"(state['global_batch']: batch_size x world size, on {state['world']} ranks) and this run has "
                f"{batch_size} x {world} = {ours}; the same global batches need the same global batch size. World "
                f"sizes that keep it: {sizes}."
            )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_epochs"] = OrderedDict()  # recomputed where needed: cheaper than shipping
        state["_progress"] = {}
        return state


class _Reader:
    """Reads samples of one iteration: keeps each shard's file open while its window is read."""

    def __init__(self, ds: Shards, epoch: order.Epoch, split: order.Split) -> None:
        self.ds, self.epoch, self.split = ds, epoch, split
        self.index = ds.index
        self.files: OrderedDict[int, int] = OrderedDict()  # shard -> fd
        self.keep = 2 * ds.shuffle_window + 2
        self.position = 0
        self.window = -1
        self.span = (0, 0)  # positions [a, b) of that window: the common case of at() is one comparison
        self.next_epoch = None
        # The loader's workers make batches w, w+n, ...; it keeps at most num_workers x prefetch_factor tasks in
        # flight (torch's default factor 2 where fastfeed's loader did not say), so another worker is at most that
        # many batches behind this one, still reading the window this one just left. A lone reader has nobody
        # behind it. More protection would only shrink the room eviction chooses from.
        workers = topology.worker()[1]
        self.margin = split.global_batch * workers * (ds._run.prefetch or 2) if workers > 1 else 0

    def at(self, position: int) -> None:
        """The iteration reaches ``position``: on entering a window, start downloading what the next one needs."""
        self.position = position
        cache = self.ds.cache
        if cache is None or self.span[0] <= position < self.span[1]:
            return
        n = self.index.n_samples
        window = self.epoch.window_of(position % n) if n else 0
        if position < n:  # past the end (padding) the epoch's first positions come again: keep asking
            self.span = (int(self.epoch.window_start[window]), int(self.epoch.window_start[window + 1]))
        if window == self.window:
            return
        self.window = window
        cache.predownload(self._upcoming(window), self.next_use)

    def _upcoming(self, window: int) -> list:
        """This window's shards, then the next ``predownload`` shards in the order (the next epoch's at the end)."""
        ds, size = self.ds, self.ds.shuffle_window
        shards = list(self.epoch.shards[window * size:(window + 1) * size])
        ahead = list(self.epoch.shards[(window + 1) * size:(window + 1) * size + ds.predownload])
        if len(ahead) < ds.predownload:
            ahead += list(ds._order(ds.epoch + 1).shards[:ds.predownload - len(ahead)])
        return [self._item(k) for k in dict.fromkeys(shards + ahead)]

    def _item(self, k: int) -> tuple:
        return (int(k), self.index.urls[k], int(self.index.sizes[k]), int(self.index.crcs[k]))

    def next_use(self, k: int) -> float:
        """When shard k is next needed, in positions from this epoch's start: -1 while it is read, or while it
        is in the window just left and another worker may still read it (up to the batches in flight ago); the
        next epoch's use (assumed ``epoch + 1``) once done. Shards about to be read have the smallest values, so
        farthest-next-use eviction keeps them.

        At most two windows are ever protected (the one read and the one before it), whatever the margin spans:
        that is the room ``Shards`` demands of ``cache_bytes``, so a read never waits for room that cannot come.
        A worker further behind than one window reads a shard it opened already (an open descriptor outlives an
        eviction), or downloads it again."""
        first, end = self.epoch.span(k)
        p = self.position % max(self.index.n_samples, 1)
        if first <= p < end:
            return -1.0
        if first > p:
            return float(first)
        if p < end + self.margin and end == self.epoch.window_start[self.epoch.window_of(p)]:
            return -1.0
        if self.next_epoch is None:
            self.next_epoch = self.ds._order(self.ds.epoch + 1)
        return float(self.split.positions_per_epoch + self.next_epoch.span(k)[0])

    def _fd(self, k: int) -> int:
        fd = self.files.get(k)
        if fd is not None:
            self.files.move_to_end(k)
            return fd
        url = self.index.urls[k]
        if self.ds.cache is not None:  # opened by the cache: reads from it stay whole if another process evicts it
            fd = self.ds.cache.fd(*self._item(k), self.next_use)
        else:
            path = remote.local_path(url)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ShardError(url, f"cannot open {path}: {e.strerror}") from e
        self.files[k] = fd
        while len(self.files) > self.keep:
            os.close(self.files.popitem(last=False)[1])
        return fd

    def sample(self, sample_id: int):
        k, start, end = self.index.locate(sample_id)
        url = self.index.urls[k]
        key = self.index.key(sample_id)
        try:
            fd = self._fd(k)
            n = end - start
            if n > _LARGE_READ:
                # No more than the file holds: a local shard's size is the index's word only, and a range past the
                # file's end must end in the error below, not in an allocation of what the index claims.
                n = max(0, min(end, os.fstat(fd).st_size) - start)
            data = os.pread(fd, n, start)
        except ShardError as e:
            raise e.with_key(key) from None
        except OSError as e:
            raise ShardError(url, f"read failed: {e.strerror}", key) from e
        if len(data) != end - start:  # the file is shorter than when it was indexed
            raise ShardError(url, f"{len(data)} of the sample's {end - start} bytes at offset {start}: the shard "
                             "is shorter than its index says", key)
        sample = read_sample(data, url, key)  # whole, or ShardError: never part of a sample
        sample["__key__"] = key
        sample["__url__"] = url
        decode = self.ds.decode
        return sample if decode is None else decode(sample)

    def close(self) -> None:
        files, self.files = self.files, OrderedDict()
        for fd in files.values():
            os.close(fd)


def _first_batch(start, w: int, nw: int) -> int:
    """The first batch worker w of nw makes: w, or the resumed position's batch plus w."""
    if start is None:
        return w
    batch, saved = start.batch, start.worker
    if saved is not None:  # a worker's own position (torch's loader, torchdata): only that worker continues it
        if list(saved) != [w, nw]:
            raise ValueError(
                f"fastfeed.io.Shards: this position was saved by worker {saved[0]} of {saved[1]} and is loaded in "
                f"worker {w} of {nw}; resume with the same num_workers, or through fastfeed.DataLoader, whose state "
                f"continues with any"
            )
        return batch
    return batch + w


def _cache_shards_needed(shuffle_window: int, predownload: int) -> int:
    """Shards the cache must hold at once: the window being read and the one before it, which a worker up to
    the batches in flight behind may still read (``_Reader.next_use`` protects no more); and the window read
    plus the ``predownload`` shards fetched ahead of it, so that read-ahead finds room."""
    return max(2 * shuffle_window, shuffle_window + predownload)


def _check_cache_bytes(cache_bytes: int | None, window: int, predownload: int, sizes) -> None:
    shards = _cache_shards_needed(window, predownload)
    largest = int(max(sizes, default=0))
    if cache_bytes is not None and cache_bytes < shards * largest:
        raise ValueError(
            f"fastfeed.io.Shards: cache_bytes={cache_bytes} cannot hold the shards read at once: "
            f"{shards} shards (max(2 x shuffle_window, shuffle_window + predownload) with shuffle_window="
            f"{window}, predownload={predownload}) of up to {largest} bytes need {shards * largest}. Raise "
            f"cache_bytes to at least {shards * largest}, or lower shuffle_window or predownload."
        )


def _load_index(urls: list[str], index, storage_options: dict, retries: int | None = None, timeout: float = 60.0,
                retry_budget: float | None = None, cache_dir=None, *, allow_outside_urls: bool = False):  # fmt: skip
    """The index of ``urls``: ``index`` (a path or URL), else the one beside them, else built by reading them.
    ``cache_dir``: where this machine's readers share a remote index's read (``ShardIndex.load``)."""
    from .index import ShardIndex, index_shards

    if index is not None:
        return ShardIndex.load(os.fspath(index) if not isinstance(index, str) else index,
                               storage_options=storage_options, retries=retries, retry_budget=retry_budget,
                               timeout=timeout, cache_dir=cache_dir, allow_outside_urls=allow_outside_urls)  # fmt: skip
    beside = _beside(urls)
    if beside is not None:
        denied = False
        try:
            found = ShardIndex.load(beside, storage_options=storage_options, retries=retries,
                                    retry_budget=retry_budget, timeout=timeout, cache_dir=cache_dir,
                                    allow_outside_urls=allow_outside_urls)  # fmt: skip
        except FileNotFoundError:
            found = None
        except PermissionError:  # S3 answers 403, not 404, for a missing key when listing is not allowed
            found, denied = None, True
        if found is not None:
            listed = set(found.urls)
            missing = [u for u in urls if u not in listed]
            if not missing:
                return found.subset(urls) if list(found.urls) != list(urls) else found
            why = (f"{beside} does not list {len(missing)} of the {len(urls)} shards (e.g. {missing[0]}): it is "
                   f"older than the shard set, or the source names shards that are not in it")  # fmt: skip
        elif denied:
            why = (f"reading {beside} was denied (HTTP 403: S3 answers so for a missing key when listing is not "
                   f"allowed)")  # fmt: skip
        else:
            why = f"no {INDEX_NAME} beside the shards"
    else:
        why = f"the shards are in several directories, so no one {INDEX_NAME} is beside them"
    warnings.warn(f"fastfeed.io.Shards: {why}; reading all {len(urls)} to index them. fastfeed.io.index_shards("
                  "source, dest=True) saves an index beside them.", stacklevel=3)  # fmt: skip
    return index_shards(urls, storage_options=storage_options, retries=retries, retry_budget=retry_budget,
                        timeout=timeout)  # fmt: skip


def _beside(urls: list[str]) -> str | None:
    """Where the index of these shards would be: beside them, if they share a directory."""
    parents = {u.rsplit("/", 1)[0] for u in urls}
    return f"{parents.pop()}/{INDEX_NAME}" if len(parents) == 1 else None


def _default_cache_dir() -> tuple[str, str | None]:
    """This user's directory in the shared temp directory: made 0700, and refused if someone else made it (or
    made it a link), since its entries are read back as shards. Returns it, and it again if this call made it."""
    path = os.path.join(tempfile.gettempdir(), f"fastfeed-shards-{os.getuid()}")
    made = path
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        made = None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"fastfeed.io.Shards: {path} is not a private directory of this user (owner uid "
                              f"{st.st_uid}, mode {stat.filemode(st.st_mode)}); pass cache_dir= to use another")
    return path, made


def _loader_batch_size(frame) -> int | None:
    """The batch size of torch's fetcher asking for this first sample, if that is who asks (None: unknown).

    torch's ``_IterableDatasetFetcher.fetch`` calls ``next()`` once per sample of a batch, with the batch's
    indices in a local; it is the only place a dataset can learn the loader's batch size, which must be the one
    the rank split was made for.
    """
    if frame is None or frame.f_code.co_name != "fetch":
        return None
    fetcher = frame.f_locals.get("self")
    indices = frame.f_locals.get("possibly_batched_index")
    if not getattr(fetcher, "auto_collation", False) or not hasattr(indices, "__len__"):
        return None
    return len(indices)


def _mismatch(ours: int, loader: int) -> str:
    return (f"fastfeed.io.Shards(batch_size={ours}) is iterated by a DataLoader with batch_size={loader}: the split "
            f"across ranks is made in batches of {ours}, so the loader's batches would mix them. Pass the same "
            f"batch_size to both, or leave Shards' unset under fastfeed.DataLoader (it tells the dataset).")
