"""Which filesystem a path is on: a network filesystem needs reads in flight, a local disk only a hint."""

from __future__ import annotations

import functools
import os

# Filesystems whose reads wait on a network round trip (FUSE covers s3fs, gcsfuse, sshfs and the like).
NETWORK = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "9p", "beegfs", "glusterfs", "fuse",
           "afs", "orangefs", "panfs", "wekafs")  # fmt: skip


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each line of /proc/self/mountinfo, longest mount point first."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        point = fields[4].replace("\\040", " ")
        mounts.append((point, fstype))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


@functools.lru_cache(maxsize=1)
def _mounts() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mountinfo") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


@functools.lru_cache(maxsize=4096)
def _type_of_dir(directory: str) -> str | None:
    for point, fstype in _mounts():
        if directory == point or directory.startswith(point.rstrip("/") + "/"):
            return fstype
    return None


def fstype(path: str) -> str | None:
    return _type_of_dir(os.path.dirname(os.path.abspath(path)))


def is_network(path: str) -> bool:
    kind = fstype(path) or ""
    return kind.split(".")[0] in NETWORK
