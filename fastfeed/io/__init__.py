"""Storage before the workers: files and URLs read ahead of need, a local cache that never thrashes, and
fixed-size records read with ``pread`` or, on a GPU, straight into device memory (GPUDirect Storage).

The read-ahead protocol: a map-style dataset may define ``prefetch(indices)``. A fastfeed worker calls it with the
sample indices of the tasks it holds and has not started, as soon as it receives them (with ``num_workers=0`` the
loader calls it one batch ahead). It must return at once; the reads it starts run in the background, and a later
``__getitem__`` takes their result. ``Files`` implements it.
"""

from .arrays import ArrayFiles
from .files import Files
from .shards import ShardError, ShardIndex, Shards, index_shards, write_shards

__all__ = ["ArrayFiles", "Files", "ShardError", "ShardIndex", "Shards", "index_shards", "write_shards"]
