"""``DALILoader``: a DALI pipeline with torch's DataLoader manners.

DALI's reader runs forever; epochs are fastfeed's bookkeeping on top of it. The reader must pad
each epoch's last batch (``pad_last_batch=True``), so that every pipeline run holds samples of
one epoch only and an epoch is exactly ``ceil(samples_per_shard / batch_size)`` runs. From that:

- ``len()`` is exact for the last-batch rule, on every rank and in every epoch (the shards are
  padded to equal sizes, as ``DistributedSampler`` pads);
- ``"partial"`` trims the padding off the last batch, ``"pad"`` yields it as DALI filled it,
  ``"drop"`` runs it and discards it;
- a new ``iter()`` in the middle of an epoch reads the rest of that epoch and discards it (DALI's
  readers cannot skip), with a warning: the next epoch starts where it should;
- ``state_dict()`` is DALI's checkpoint of the outputs consumed so far plus the position in the
  epoch, so a new process resumes at the next batch.
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from .. import stats
from .._state_check import check_dali_state
from . import build
from .convert import Converter

LAST_BATCH = ("partial", "drop", "pad")
READY_S = 0.0005  # an output that took less than this was made before it was asked for
STATE_VERSION = 1


class DALILoader:
    """Iterate a DALI pipeline like a ``torch.utils.data.DataLoader``.

    Args:
        pipeline: a ``@pipeline_def`` function, which fastfeed calls with ``**pipeline_kwargs`` (plus
            this rank's ``shard_id`` / ``num_shards`` / ``pad_last_batch`` where it declares them)
            and builds on this rank's CPUs; or a DALI ``Pipeline`` (built or not), used as it is.
        output_map: a name per pipeline output: batches are dicts ``{name: tensor}``; a tuple of
            names, or an int (the number of outputs), gives tuples instead.
        reader_name: the ``name=`` of the pipeline's reader, whose size defines the epoch.
        last_batch: ``"partial"`` (torch's default), ``"drop"`` (``drop_last=True``) or ``"pad"``
            (a full last batch, filled with copies of the shard's last sample).
        device: where batches go (``"cpu"``, ``"cuda:N"``, or ``"cuda"``: the current device); None leaves them
            where the pipeline made them. For a ``pipeline_def``, a CUDA device is also the pipeline's
            ``device_id``. CPU outputs bound for a GPU go through reused pinned buffers, so their copy does not
            block the loop.
        auto_shard: shard the reader by rank under ``torch.distributed`` or torchrun.
        numa: ``"auto"`` places DALI's threads on the GPU's NUMA node (CUDA only), a node
            number places them there, ``"off"`` leaves them alone.
        **pipeline_kwargs: for a ``pipeline_def``: ``batch_size``, ``num_threads`` (default: this
            rank's CPUs), ``prefetch_queue_depth`` (default 2), ``seed`` (default: drawn from
            torch's generator, so ``torch.manual_seed`` makes runs repeatable), and the
            function's own arguments.
    """

    def __init__(self, pipeline, output_map, *, reader_name: str = "Reader", last_batch: str = "partial",
                 device=None, auto_shard: bool = True, numa="auto", **pipeline_kwargs):  # fmt: skip
        if last_batch not in LAST_BATCH:
            raise ValueError(f"last_batch must be one of {LAST_BATCH}, got {last_batch!r}")
        self.device = _device(device)
        self.reader_name = reader_name
        self.last_batch = last_batch
        self.rank, self.world = build.rank_and_world() if auto_shard else (0, 1)
        self.auto_shard = auto_shard
        self._names, self._as_dict = _output_names(output_map)
        self._fn = None
        self._pipe = None
        if build.is_pipeline_def(pipeline):
            self._fn = pipeline
            self._kwargs = _pipeline_kwargs(pipeline_kwargs, self.device)
            self._kwargs = build.call_args(pipeline, self._kwargs, self.rank, self.world, auto_shard)
            threads, depth = self._kwargs["num_threads"], self._kwargs["prefetch_queue_depth"]
            gpu = self._kwargs.get("device_id")
            target = torch.device("cuda", gpu) if gpu is not None else self.device
        elif _is_pipeline(pipeline):
            if pipeline_kwargs:
                raise TypeError(f"DALILoader got pipeline arguments {sorted(pipeline_kwargs)} for a Pipeline that "
                                "is already made: pass them when making it, or pass the @pipeline_def "
                                "function")  # fmt: skip
            self._pipe = pipeline
            threads, depth = pipeline.num_threads, _depth(pipeline.prefetch_queue_depth)
            target = torch.device("cuda", pipeline.device_id) if pipeline.device_id is not None else self.device
        else:
            raise TypeError("DALILoader takes a DALI Pipeline or a @pipeline_def function, got "
                            f"{type(pipeline).__name__}")
        self.num_threads, self.prefetch_queue_depth = threads, depth
        self._where = build.placement(numa, target, threads)
        self._built = False
        self._checkpoint = None  # a loaded state's DALI checkpoint, applied at the build
        self._epoch = 0
        self._runs = 0  # pipeline runs consumed in the current epoch
        self._resuming = False
        self._generation = 0
        self._ff_stats: stats.Recorder | None = None
        self._convert = Converter(self._names, self.device)

    # -- torch's DataLoader surface ---------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self._pipe_batch_size()

    @property
    def drop_last(self) -> bool:
        return self.last_batch == "drop"

    @property
    def num_workers(self) -> int:
        """DALI's CPU threads: what the tuner and the doctor count as workers."""
        return self.num_threads

    @property
    def prefetch_factor(self) -> int:
        return self.prefetch_queue_depth

    def __len__(self) -> int:
        self._ensure_built()
        if self.last_batch == "drop":
            return self._samples // self._batch
        return self._runs_per_epoch

    def __iter__(self):
        self._ensure_built()
        self._generation += 1
        if self._resuming:
            self._resuming = False
        elif self._runs:
            self._finish_epoch(early=True)
        rec = stats.recorder(self.num_threads, self.prefetch_queue_depth)
        self._ff_stats = rec
        return _Iter(self, self._generation, rec)

    def stats(self) -> stats.Stats:
        """The latest epoch's measurements (as ``fastfeed.DataLoader.stats()``)."""
        return stats.Stats.of(self._ff_stats)

    def state_dict(self) -> dict:
        """The position after the batches yielded so far: DALI's checkpoint plus the epoch bookkeeping."""
        self._ensure_built()
        return {
            "fastfeed_dali": STATE_VERSION,
            "checkpoint": self._pipe.checkpoint(),
            "epoch": self._epoch,
            "runs": self._runs,
            "batch_size": self._batch,
            "samples_per_shard": self._samples,
            "shard": [self._shard_id, self._shards],
            "last_batch": self.last_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``: the next ``iter()`` yields the batches after the saved ones (a new pipeline)."""
        # Checked whole before the pipeline is closed or its checkpoint handed to DALI (see _state_check).
        check_dali_state(state, STATE_VERSION, "DALILoader.load_state_dict")
        if self._fn is None:
            raise ValueError("load_state_dict: DALILoader can restore only a pipeline it builds: pass the "
                             "@pipeline_def function instead of a made Pipeline (or make the Pipeline with "
                             "checkpoint=state['checkpoint'] yourself)")  # fmt: skip
        self.close()
        self._checkpoint = state["checkpoint"]
        self._ensure_built()
        mine = {"batch_size": self._batch, "samples_per_shard": self._samples, "shard": [self._shard_id, self._shards],
                "last_batch": self.last_batch}  # fmt: skip
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            self.close()
            diff = ", ".join(f"{k}: saved {theirs[k]!r}, now {mine[k]!r}" for k in mine if theirs[k] != mine[k])
            raise ValueError(f"load_state_dict: the state was saved by a different loader ({diff})")
        if state["runs"] > self._runs_per_epoch:  # a run past the epoch's end: the epoch would end at once
            self.close()
            raise ValueError(f"DALILoader.load_state_dict: state['runs'] is {state['runs']}; expected at most "
                             f"{self._runs_per_epoch}, the batches of this loader's epoch")  # fmt: skip
        self._epoch, self._runs = state["epoch"], state["runs"]
        self._resuming = True

    def close(self) -> None:
        """Stop DALI's threads and free its buffers now (a pipeline passed in made is only dropped)."""
        self._generation += 1
        if self._fn is None:  # the caller's pipeline: theirs to shut down
            return
        pipe, self._pipe = self._pipe, None
        self._built = False
        if pipe is not None:
            pipe._shutdown()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _continue_epoch(self) -> None:
        """The next ``iter()`` continues the current epoch (the doctor measures on after interrupting one)."""
        self._resuming = bool(self._runs)

    # -- the pipeline -----------------------------------------------------------------------

    def _pipe_batch_size(self) -> int:
        if self._pipe is not None:
            return self._pipe.max_batch_size
        return self._kwargs["batch_size"]

    def _ensure_built(self) -> None:
        if self._built:
            return
        if self._pipe is None:
            kwargs = dict(self._kwargs)
            if self._checkpoint is not None:
                kwargs["checkpoint"] = self._checkpoint
            self._pipe = self._fn(**kwargs)
        with build.placed(self._where):
            self._pipe.build()
        self._built = True
        self._read_meta()

    def _read_meta(self) -> None:
        pipe = self._pipe
        readers = pipe.reader_meta() or {}
        if self.reader_name not in readers:
            found = f"its readers are named {sorted(readers)}" if readers else "it has no reader"
            raise ValueError(f"DALILoader needs the pipeline's reader, named {self.reader_name!r}, to know the epoch; "
                             f"{found}: pass reader_name=, or name=... to the reader")  # fmt: skip
        meta = readers[self.reader_name]
        if not meta["pad_last_batch"]:
            raise ValueError(f"DALILoader needs the reader {self.reader_name!r} to pad each epoch's last batch, so "
                             "that epochs never share a batch: pass pad_last_batch=True to it")  # fmt: skip
        self._shards, self._shard_id = meta["number_of_shards"], meta["shard_id"]
        if self.auto_shard and self.world > 1 and (self._shards, self._shard_id) != (self.world, self.rank):
            raise ValueError(f"rank {self.rank} of {self.world}: the reader {self.reader_name!r} reads shard "
                             f"{self._shard_id} of {self._shards}; make it with shard_id={self.rank}, "
                             f"num_shards={self.world}, or pass auto_shard=False")  # fmt: skip
        self._batch = pipe.max_batch_size
        self._samples = meta["epoch_size_padded"] // self._shards
        if self._samples == 0:
            raise ValueError(f"the reader {self.reader_name!r} has no samples for shard {self._shard_id}")
        self._runs_per_epoch = math.ceil(self._samples / self._batch)
        self._last_real = self._samples - (self._runs_per_epoch - 1) * self._batch

    def _run(self) -> tuple[tuple, float]:
        t0 = time.perf_counter()
        try:
            outputs = self._pipe.run()
        except RuntimeError as e:
            raise RuntimeError(f"the DALI pipeline failed in epoch {self._epoch}, batch {self._runs}: {e}") from e
        self._runs += 1
        return outputs, time.perf_counter() - t0

    def _finish_epoch(self, early: bool) -> None:
        """Read and discard the rest of this epoch's runs; the next run starts the next epoch."""
        left = self._runs_per_epoch - self._runs
        if early and self._runs < len(self):
            warnings.warn(f"DALILoader: a new epoch was started {len(self) - self._runs} batches before the end of "
                          f"epoch {self._epoch}; DALI's reader cannot skip, so those batches are read and discarded "
                          "first", RuntimeWarning, stacklevel=3)  # fmt: skip
        for _ in range(left):
            self._run()
        self._epoch += 1
        self._runs = 0


class _Iter:
    """One epoch of a ``DALILoader``; a newer ``iter(loader)`` supersedes it."""

    def __init__(self, loader: DALILoader, generation: int, rec: stats.Recorder | None):
        self._loader = loader
        self._generation = generation
        self._rec = rec
        self._done = False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self):
        loader = self._loader
        if self._done:
            raise StopIteration
        if self._generation != loader._generation:
            raise RuntimeError("this DALILoader iterator was superseded by a newer iter(loader) (or the loader "
                               "was closed or restored): a DALI pipeline serves one epoch at a time")  # fmt: skip
        asked = time.perf_counter()
        if loader._runs >= len(loader):
            self._done = True
            loader._finish_epoch(early=False)
            raise StopIteration
        outputs, waited = loader._run()
        real = loader._last_real if loader._runs == loader._runs_per_epoch and loader.last_batch == "partial" else None
        batch = loader._convert(outputs, real)
        if loader._as_dict is False:
            batch = tuple(batch.values())
        if self._rec is not None:
            self._rec.add(asked, 1 if waited < READY_S else 0, time.perf_counter())
        return batch


def _device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be None, 'cpu' or 'cuda[:N]', got {device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"DALILoader(device={str(device)!r}): CUDA is not available on this machine (torch "
                           f"{torch.__version__}); use device=None or 'cpu' with a CPU pipeline")  # fmt: skip
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    if device.type == "cuda":
        # "cuda" is torch's current device (set_device), as for tensor.to("cuda"); DALI needs the number.
        index = torch.cuda.current_device() if device.index is None else device.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"DALILoader(device={str(device)!r}): this process sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1} (CUDA_VISIBLE_DEVICES narrows them)")  # fmt: skip
        device = torch.device("cuda", index)
    return device


def _output_names(output_map) -> tuple[list[str], bool]:
    if isinstance(output_map, int) and not isinstance(output_map, bool) and output_map > 0:
        return [str(i) for i in range(output_map)], False
    if isinstance(output_map, (list, tuple)) and output_map and all(isinstance(n, str) for n in output_map):
        if len(set(output_map)) != len(output_map):
            raise ValueError(f"output_map has repeated names: {list(output_map)}")
        return list(output_map), isinstance(output_map, list)
    raise TypeError(f"output_map must be a list of names (dict batches), a tuple of names or an int (tuple batches), "
                    f"got {output_map!r}")  # fmt: skip


def _pipeline_kwargs(kwargs: dict, device: torch.device | None) -> dict:
    kwargs = dict(kwargs)
    if "batch_size" not in kwargs:
        raise TypeError("DALILoader needs batch_size= to build a @pipeline_def pipeline")
    if "num_threads" not in kwargs:
        from ..tuning.offline import rank_cpus

        kwargs["num_threads"] = rank_cpus({"device": device} if device is not None else {})
    kwargs.setdefault("prefetch_queue_depth", 2)
    if "device_id" not in kwargs:
        kwargs["device_id"] = device.index if device is not None and device.type == "cuda" else None
    if kwargs.get("seed") is None:
        kwargs["seed"] = int(torch.empty((), dtype=torch.int64).random_(0, 2**31 - 1).item())
    return kwargs


def _is_pipeline(obj) -> bool:
    from nvidia.dali import Pipeline

    return isinstance(obj, Pipeline)


def _depth(depth) -> int:
    return depth if isinstance(depth, int) else max(depth.values()) if isinstance(depth, dict) else int(depth)
