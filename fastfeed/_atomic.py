"""Writing a file so that readers never see half of it, for every file fastfeed writes outside shared memory
(the tuning cache and config, the doctor's reports, the storage cache's entries)."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path, *chunks: bytes | str, mode: int = 0o600) -> None:
    """Write ``chunks`` to ``path`` through a temporary file in the same directory, then rename it into place.

    The temporary file is made by ``mkstemp``: created exclusively, mode 0600, under a name nobody can guess;
    ``mode`` is what the file has once in place. Concurrent writers of one path each rename a whole file, so the
    last one wins and nobody sees a mix.
    """
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk.encode() if isinstance(chunk, str) else chunk)
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
