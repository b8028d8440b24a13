"""The one error a shard read ends in, once its retries are spent."""

from __future__ import annotations

import re

from .. import remote

# How the message reads, so that one re-raised from a worker's text (torch's loader re-raises by message) keeps
# its fields.
_MESSAGE = re.compile(r"shard (?P<shard>\S+?)(?:, sample (?P<key>'.*?'))?: (?P<detail>.*)$", re.M)


class ShardError(OSError):
    """A shard could not be read whole: it is missing, a request failed every retry, or its bytes are short or
    damaged. Names the shard and, where a sample was being read, its key; no part of that sample was yielded.

    ``ShardError(message)`` (one argument: how torch's loader re-raises a worker's error) takes the fields from
    the message's last ``shard ...: ...`` line.
    """

    def __init__(self, shard: str, detail: str | None = None, key: str | None = None) -> None:
        if detail is None:
            message = shard
            found = list(_MESSAGE.finditer(message))
            last = found[-1] if found else None
            self.shard = last["shard"] if last else None
            self.key = last["key"][1:-1] if last and last["key"] else None
            self.detail = last["detail"] if last else message
            super().__init__(message)
            return
        self.shard, self.detail, self.key = shard, detail, key
        where = f"shard {shard}" + (f", sample {key!r}" if key is not None else "")
        super().__init__(f"{where}: {detail}")

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):  # raised in a worker, re-raised in the main process with its fields
        return type(self), (self.shard, self.detail, self.key)

    @classmethod
    def gave_up(cls, shard: str, error: OSError, doing: str, key: str | None = None) -> ShardError:
        """What a request for ``shard`` ends in once ``fastfeed.io.remote.retry`` stopped: missing, denied, or
        ``doing`` ("download", "read") failed every attempt (``error`` is retry's FileNotFoundError,
        PermissionError or RemoteError)."""
        if isinstance(error, FileNotFoundError):
            return cls(shard, f"not found ({remote.describe(error)})", key)
        if isinstance(error, PermissionError):
            return cls(shard, f"access denied ({remote.describe(error)}); check storage_options' credentials", key)
        return cls(shard, f"{doing} {error}", key)

    def with_key(self, key: str) -> ShardError:
        """The same error, naming the sample whose read needed the shard."""
        return self if self.key is not None else type(self)(self.shard, self.detail, key)
