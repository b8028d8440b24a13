"""The one error a shard read ends in, once its retries are spent."""

from __future__ import annotations


class ShardError(OSError):
    """A shard could not be read whole: it is missing, a request failed every retry, or its bytes are short or
    damaged. Names the shard and, where a sample was being read, its key; no part of that sample was yielded."""

    def __init__(self, shard: str, detail: str, key: str | None = None) -> None:
        self.shard, self.detail, self.key = shard, detail, key
        where = f"shard {shard}" + (f", sample {key!r}" if key is not None else "")
        super().__init__(f"{where}: {detail}")

    def __reduce__(self):  # raised in a worker, re-raised in the main process with its fields
        return type(self), (self.shard, self.detail, self.key)

    def with_key(self, key: str) -> ShardError:
        """The same error, naming the sample whose read needed the shard."""
        return self if self.key is not None else type(self)(self.shard, self.detail, key)
