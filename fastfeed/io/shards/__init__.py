"""Datasets in tar shards (WebDataset's format), local or in object storage: ``Shards`` reads them,
``write_shards`` writes any map-style dataset into them, ``index_shards`` indexes existing ones."""

from .dataset import Shards
from .errors import ShardError
from .index import ShardIndex, index_shards
from .write import write_shards

__all__ = ["ShardError", "ShardIndex", "Shards", "index_shards", "write_shards"]
