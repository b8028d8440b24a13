"""Tar shards, read without ``tarfile``: one sample's bytes parsed in the hot loop, and one streaming pass per shard
for the index.

A shard is a tar archive in WebDataset's convention: the members that share a key are one sample (``k.jpg``,
``k.cls`` -> sample ``k`` with exts ``jpg`` and ``cls``), and they are adjacent. The key/ext split is webdataset's
``base_plus_ext``: the key runs to the first dot after the last slash (``a/b.c.jpg`` -> ``a/b``, ``c.jpg``); exts
are lowercased, as webdataset's reader does. Members that are not regular files (directories, links), names without
an ext, and webdataset's metadata names (``__x__``, ``__x__/...``) are skipped, as webdataset skips them.

Formats read: ustar (with its name prefix), GNU (``L`` long names, base-256 sizes) and POSIX pax (``x`` headers'
``path`` and ``size``; ``g`` global headers are skipped). Every header's checksum is verified, and each member's
data must be whole: a short or damaged sample raises ``ShardError`` naming the shard and the key, and no part of it
is returned.
"""

from __future__ import annotations

import re
import zlib
from typing import BinaryIO, Iterator

from .errors import ShardError

BLOCK = 512
CHUNK = 4 << 20  # the scanner's reads: large, so a remote shard streams in few requests
_SPLIT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_ZERO = bytes(BLOCK)
_REGULAR = frozenset(b"07\0")  # regular file, contiguous file, old-style regular
_NO_DATA = frozenset(b"123456")  # links, devices, directories, fifos: their size field is not data
_LONGNAME, _PAX, _GLOBAL_PAX, _LONGLINK = ord("L"), ord("x"), ord("g"), ord("K")
_HEADERS = frozenset((_LONGNAME, _PAX, _GLOBAL_PAX, _LONGLINK))  # headers about the next member, not members


def split(name: str) -> tuple[str | None, str | None]:
    """``(key, ext)`` of a member name as webdataset splits it; ``(None, None)`` for a name it skips."""
    if name.startswith("__") and (("/" not in name and name.endswith("__")) or _META.match(name)):
        return None, None
    m = _SPLIT.match(name)
    if m is None:
        return None, None
    return m.group(1), m.group(2).lower()


def _number(field: bytes, where: str) -> int:
    """A numeric header field: octal ASCII, or GNU's base-256 (first byte 0x80/0xff) for large values."""
    if field and field[0] & 0x80:
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[0] == 0xFF else n
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ValueError(f"{where}: bad number field {field!r}") from None


def _check(header, where: str) -> None:
    """Verify a header block's checksum (unsigned sum, or the signed sum some old writers used)."""
    try:
        stored = int(bytes(header[148:156]).split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        raise ValueError(f"{where}: damaged header (checksum field {bytes(header[148:156])!r})") from None
    # Adler-32's low half is 1 + the byte sum mod 65521, exact for 256 bytes (at most 65280): two C calls instead
    # of a Python sum over 512 ints, a third of the parse of a small sample.
    unsigned = (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2
    unsigned += 256 - sum(header[148:156])
    if stored == unsigned:
        return
    signed = unsigned - sum(b for b in header if b > 127) * 2 + sum(b for b in header[148:156] if b > 127) * 2
    if stored != signed:
        raise ValueError(f"{where}: damaged header (checksum {stored} != {unsigned})")


def _text(raw) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(data: bytes, where: str) -> dict[str, str]:
    """The records of a pax header: ``"<len> <key>=<value>\\n"``, each length counting the whole record."""
    out, pos = {}, 0
    while pos < len(data):
        if data[pos] == 0:  # padding some writers leave
            break
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise ValueError(f"{where}: damaged pax header") from None
        record = data[space + 1 : pos + length]
        if length <= 0 or pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise ValueError(f"{where}: damaged pax header")
        k, _, v = record[:-1].partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        pos += length
    return out


class _Header:
    """One header block, parsed: ``typeflag``, ``size`` (of the data that follows), ``name`` (ustar's, with prefix)."""

    __slots__ = ("typeflag", "size", "name")

    def __init__(self, block, where: str) -> None:
        _check(block, where)
        self.typeflag = block[156]
        self.size = _number(bytes(block[124:136]), where)
        if self.size < 0:
            raise ValueError(f"{where}: negative member size")
        name = _text(block[0:100])
        prefix = _text(block[345:500]) if block[257:263] == b"ustar\x00" else ""
        if prefix and self.typeflag not in (_LONGNAME, _LONGLINK):
            name = prefix + "/" + name
        if self.typeflag == 0 and name.endswith("/"):  # old tars mark directories by the slash alone
            self.typeflag = ord("5")
        self.name = name

    def data_size(self, pax_size: int | None) -> int:
        """Bytes of data after this header; a pax ``size`` applies to the member, not to other headers."""
        t = self.typeflag
        if t in _NO_DATA:
            return 0
        if pax_size is None or t in _HEADERS:
            return self.size
        return pax_size


def _padded(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def read_sample(buf, shard: str, key: str) -> dict[str, bytes]:
    """Parse one sample's byte range (as an index locates it) into ``{ext: bytes}``.

    Args:
        buf: the bytes from the sample's first header to the next sample's (bytes, bytearray or memoryview).
        shard: the shard's URL, for errors.
        key: the sample's key: every member in the range must have it.

    Returns:
        ``{ext: data}`` for each member of the sample, in tar order.

    Raises:
        ShardError: the range is short (cut in a header or in a member's data), a header is damaged (checksum), a
            member belongs to another sample or repeats an ext (the index does not match the shard), or the range
            holds no member of the sample.
    """
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    end = len(view)
    pos = 0
    out: dict[str, bytes] = {}
    long_name = None
    pax_name = pax_size = None
    try:
        while pos < end:
            if pos + BLOCK > end:
                raise ValueError(f"cut short in a header at byte {pos} of the sample's {end}")
            block = bytes(view[pos : pos + BLOCK])
            if block == _ZERO:
                raise ValueError(f"end-of-archive block at byte {pos} of the sample's {end}")
            h = _Header(block, f"header at byte {pos} of the sample")
            size = h.data_size(pax_size)
            data_at = pos + BLOCK
            if data_at + size > end:
                raise ValueError(f"cut short in the data of member {pax_name or long_name or h.name!r} "
                                 f"({size} bytes at {data_at}; the sample's range ends at {end})")  # fmt: skip
            pos = data_at + _padded(size)
            t = h.typeflag
            if t == _LONGNAME:
                long_name = _text(view[data_at : data_at + size])
                continue
            if t == _PAX:
                pax = _pax(bytes(view[data_at : data_at + size]), f"pax header at byte {data_at - BLOCK}")
                pax_name = pax.get("path", pax_name)
                if "size" in pax:
                    pax_size = int(pax["size"])
                continue
            if t == _GLOBAL_PAX or t == _LONGLINK:
                continue
            name = pax_name or long_name or h.name
            long_name = pax_name = pax_size = None
            if t not in _REGULAR:
                continue
            k, ext = split(name)
            if k is None:
                continue
            if k != key:
                raise ValueError(f"member {name!r} belongs to sample {k!r}: the index does not match this shard")
            if ext in out:
                raise ValueError(f"member {name!r} repeats ext {ext!r} in the sample")
            out[ext] = bytes(view[data_at : data_at + size])
        if long_name is not None or pax_name is not None or pax_size is not None:
            raise ValueError(f"cut short after the long-name header of a member, at byte {end}")
    except ValueError as e:
        raise ShardError(shard, str(e), key) from None
    if not out:
        raise ShardError(shard, "no member of the sample in its byte range: the index does not match this shard", key)
    return out


class _Reader:
    """Sequential reads of a file object in large chunks, with the crc32 and count of every byte read."""

    def __init__(self, f: BinaryIO, chunk: int) -> None:
        self.f, self.chunk = f, chunk
        self.buf = b""
        self.at = 0  # position in buf
        self.base = 0  # file offset of buf[0]
        self.crc = 0
        self.nread = 0

    @property
    def offset(self) -> int:
        return self.base + self.at

    def _more(self) -> bool:
        data = self.f.read(self.chunk)
        if not data:
            return False
        self.crc = zlib.crc32(data, self.crc)
        self.nread += len(data)
        self.base += self.at
        self.buf = self.buf[self.at :] + data if self.at < len(self.buf) else data
        self.at = 0
        return True

    def take(self, n: int) -> bytes:
        """The next n bytes, or fewer at the end of the file."""
        while len(self.buf) - self.at < n and self._more():
            pass
        out = self.buf[self.at : self.at + n]
        self.at += len(out)
        return out

    def skip(self, n: int) -> int:
        """Skip n bytes without keeping them; the bytes skipped (fewer at the end of the file)."""
        have = len(self.buf) - self.at
        if n <= have:
            self.at += n
            return n
        done = have
        self.base += len(self.buf)
        self.buf, self.at = b"", 0
        while done < n:
            data = self.f.read(self.chunk)
            if not data:
                return done
            self.crc = zlib.crc32(data, self.crc)
            self.nread += len(data)
            if done + len(data) > n:
                self.buf, self.at = data, n - done
                return n
            self.base += len(data)
            done += len(data)
        return done

    def drain(self) -> None:
        """Read to the end of the file (for its size and crc)."""
        self.base += len(self.buf)
        self.buf, self.at = b"", 0
        while True:
            data = self.f.read(self.chunk)
            if not data:
                return
            self.crc = zlib.crc32(data, self.crc)
            self.nread += len(data)
            self.base += len(data)


class Scan:
    """One streaming pass over a shard: ``samples()`` yields ``(key, offset of its first header)`` in order; after
    it ends, ``end`` is the offset where the last sample's range ends, ``size`` and ``crc`` the whole file's.

    Raises ``ShardError`` for a damaged or short shard, and for a key seen again after another sample (webdataset
    assumes a sample's members are adjacent, so it would read two samples there).
    """

    def __init__(self, f: BinaryIO, shard: str, chunk: int = CHUNK) -> None:
        self.shard = shard
        self._r = _Reader(f, chunk)
        self.end = 0
        self.size = 0
        self.crc = 0

    def samples(self) -> Iterator[tuple[str, int]]:
        r, shard = self._r, self.shard
        seen: set[str] = set()
        current = None
        exts: set[str] = set()
        first_header = None  # offset of the first header of the member being read (its L/x headers included)
        long_name = pax_name = pax_size = None
        while True:
            at = r.offset
            block = r.take(BLOCK)
            if len(block) < BLOCK:
                if block or first_header is not None:
                    raise ShardError(shard, f"cut short in a header at byte {at}", current)
                break  # a tar without end-of-archive blocks: tarfile reads it, so do we
            if block == _ZERO:
                if first_header is not None:
                    raise ShardError(shard, f"end-of-archive block at byte {at} after a member's long-name header")
                break
            try:
                h = _Header(block, f"header at byte {at}")
                size = h.data_size(pax_size)
                t = h.typeflag
                data = None
                if t in (_LONGNAME, _PAX):
                    data = r.take(size)
                    if len(data) < size:
                        raise ValueError(f"cut short in the data of a long-name header at byte {at}")
                    r.skip(_padded(size) - size)
                else:
                    if r.skip(size) < size:
                        name = pax_name or long_name or h.name
                        raise ShardError(shard, f"cut short in the data of member {name!r} (at byte {at + BLOCK}, "
                                         f"{size} bytes)", split(name)[0] or current)  # fmt: skip
                    r.skip(_padded(size) - size)  # a last member without its padding is read whole by tarfile
                if first_header is None:
                    first_header = at
                if t == _LONGNAME:
                    long_name = _text(data)
                    continue
                if t == _PAX:
                    pax = _pax(data, f"pax header at byte {at}")
                    pax_name = pax.get("path", pax_name)
                    if "size" in pax:
                        pax_size = int(pax["size"])
                    continue
                if t == _GLOBAL_PAX or t == _LONGLINK:
                    if long_name is None and pax_name is None:
                        first_header = None
                    continue
            except ValueError as e:
                raise ShardError(shard, str(e), current) from None
            name = pax_name or long_name or h.name
            long_name = pax_name = pax_size = None
            member_at, first_header = first_header, None
            if t not in _REGULAR:
                continue
            key, ext = split(name)
            if key is None:
                continue
            if key != current:
                if key in seen:
                    raise ShardError(shard, f"member {name!r} comes after other samples: a sample's members must be "
                                     "adjacent in its shard (webdataset reads them as two samples)", key)  # fmt: skip
                seen.add(key)
                current, exts = key, set()
                yield key, member_at
            elif ext in exts:
                raise ShardError(shard, f"member {name!r} repeats ext {ext!r} in its sample", key)
            exts.add(ext)
        # The last sample's range runs to the end-of-archive block: skipped members after it are in it, as they are
        # in the ranges of the samples they follow.
        self.end = at if current is not None else 0
        r.drain()
        self.size, self.crc = r.nread, r.crc
