"""Tar shards, read without ``tarfile``: one sample's bytes parsed in the hot loop, and one streaming pass per shard
for the index.

A shard is a tar archive in WebDataset's convention: the members that share a key are one sample (``k.jpg``,
``k.cls`` -> sample ``k`` with exts ``jpg`` and ``cls``), and they are adjacent. The key/ext split is webdataset's
``base_plus_ext``: the key runs to the first dot after the last slash (``a/b.c.jpg`` -> ``a/b``, ``c.jpg``); exts
are lowercased, as webdataset's reader does. Members that are not regular files (directories, links), names without
an ext, and webdataset's metadata names (``__x__``, ``__x__/...``) are skipped, as webdataset skips them.

Formats read: ustar (with its name prefix), GNU (``L`` long names, ``K`` long link names, base-256 sizes) and POSIX
pax (``x`` headers' ``path`` and ``size``; ``g`` global headers, see ``Members``). Both passes walk the headers with
``Members``, so they agree on every member and on where each starts. Every header's checksum is verified, and each
member's data must be whole: a short or damaged sample raises ``ShardError`` naming the shard and the key, and no
part of it is returned.
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
_LONGNAME, _PAX, _GLOBAL_PAX, _LONGLINK, _DIR = ord("L"), ord("x"), ord("g"), ord("K"), ord("5")
_HEADERS = frozenset((_LONGNAME, _PAX, _GLOBAL_PAX, _LONGLINK))  # headers about other members, not members


def split(name: str) -> tuple[str | None, str | None]:
    """``(key, ext)`` of a member name as webdataset splits it; ``(None, None)`` for a name it skips."""
    if name.startswith("__") and (("/" not in name and name.endswith("__")) or _META.match(name)):
        return None, None
    m = _SPLIT.match(name)
    if m is None:
        return None, None
    return m.group(1), m.group(2).lower()


def _number(field: bytes) -> int:
    """A numeric header field: octal ASCII, or GNU's base-256 (first byte 0x80/0xff) for large values."""
    if field and field[0] & 0x80:
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[0] == 0xFF else n
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise ValueError(f"bad number field {field!r}") from None


def _check(header: bytes) -> None:
    """Verify a header block's checksum (unsigned sum, or the signed sum some old writers used)."""
    try:
        stored = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        raise ValueError(f"damaged header (checksum field {header[148:156]!r})") from None
    # Adler-32's low half is 1 + the byte sum mod 65521, exact for 256 bytes (at most 65280): two C calls instead
    # of a Python sum over 512 ints, a third of the parse of a small sample.
    unsigned = (zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2
    unsigned += 256 - sum(header[148:156])
    if stored == unsigned:
        return
    signed = unsigned - sum(b for b in header if b > 127) * 2 + sum(b for b in header[148:156] if b > 127) * 2
    if stored != signed:
        raise ValueError(f"damaged header (checksum {stored} != {unsigned})")


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


class _Cut(ValueError):
    """A member's data cut short; ``name`` is the member's, for the sample the error names."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class Members:
    """The one walk over a tar's headers, for the sample reader and the scanner alike.

    Iterating yields each member once as ``(start, name, typeflag, data_at, size)``: ``start`` is the offset of its
    first header, ``name`` the one its headers resolve to, ``data_at`` and ``size`` where its data lies. The bytes
    come from ``src.take(n)`` and ``src.skip(n)`` (fewer at the end), so a stream is walked without being held:
    member data is skipped, never read, and the caller slices it from its buffer if it has one. Offsets count from
    where ``src`` stood when the walk began.

    Headers about the next member are applied to it and are no member themselves. Like tarfile, the member's
    ``start`` is the first of them: GNU ``L`` (its name) and ``K`` (its link's name), and pax ``x`` (``path`` and
    ``size`` read; where a member has both, its pax ``path`` outranks its ``L`` name). A pax ``g`` header is no
    part of the member after it (tarfile does not count it in that member's offset). GNU tar and tarfile apply its
    records to every member after it, which a sample read from its own range cannot see; and one ``path`` (or one
    ``size``) for every member is no webdataset shard. So a ``g`` that sets ``path`` or ``size`` is refused, and one
    that sets anything else (git archive's ``comment``, an ``mtime``) is skipped: those change no name or byte read
    here.

    The walk stops at an end-of-archive block (``closed``) or where the bytes end; ``end`` is that offset. Raises
    ``ValueError`` for a damaged header or one cut short, and for headers with no member after them; ``_Cut`` (a
    ValueError) for a member's data cut short.
    """

    __slots__ = ("_src", "_length", "end", "closed")

    def __init__(self, src, length: int | None = None) -> None:
        self._src = src
        self._length = length  # of a sample's range, for errors
        self.end = 0
        self.closed = False

    def _at(self, pos: int) -> str:
        return f"byte {pos}" if self._length is None else f"byte {pos} of the sample's {self._length}"

    def __iter__(self) -> Iterator[tuple[int, str, int, int, int]]:
        take, skip = self._src.take, self._src.skip
        pos = 0
        start = long_name = pax_name = pax_size = None  # start is not None: headers wait for their member
        while True:
            block = take(BLOCK)
            if len(block) < BLOCK:
                if block:
                    raise ValueError(f"cut short in a header at {self._at(pos)}")
                break  # a tar without end-of-archive blocks: tarfile reads it, so do we
            if block == _ZERO:
                self.closed = True
                break
            try:
                _check(block)
                size = _number(block[124:136])
                if size < 0:
                    raise ValueError("negative member size")
            except ValueError as e:
                raise ValueError(f"header at {self._at(pos)}: {e}") from None
            t = block[156]
            if t in _HEADERS:
                data = take((size + BLOCK - 1) & ~(BLOCK - 1))
                if len(data) < size:
                    raise ValueError(f"cut short in the data of a long-name header at {self._at(pos)}")
                header_at, pos = pos, pos + BLOCK + len(data)
                if t == _GLOBAL_PAX:
                    where = f"global pax header at {self._at(header_at)}"
                    kept = {"path", "size"} & _pax(data[:size], where).keys()
                    if kept:
                        raise ValueError(f"{where} sets {', '.join(sorted(kept))} for every member after it (as "
                                         "GNU tar and tarfile read it), which a sample read from its own byte range "
                                         "cannot see: write the shard without it")  # fmt: skip
                    continue
                if start is None:
                    start = header_at
                if t == _LONGNAME:
                    long_name = _text(data[:size])
                elif t == _PAX:
                    pax = _pax(data[:size], f"pax header at {self._at(header_at)}")
                    pax_name = pax.get("path", pax_name)
                    if "size" in pax:
                        text = pax["size"]
                        if not (text.isascii() and text.isdigit()):  # int() takes "-1", " 1" and "1_0"
                            raise ValueError(f"pax header at {self._at(header_at)}: bad size {text!r}")
                        pax_size = int(text)
                continue  # K: a link's target, which no reader here needs
            if start is None:
                start = pos
            if pax_name is not None:
                name = pax_name
            elif long_name is not None:
                name = long_name
            else:
                name = _text(block[0:100])
                if block[257:263] == b"ustar\x00":
                    prefix = _text(block[345:500])
                    if prefix:
                        name = prefix + "/" + name
            if t == 0 and _text(block[0:100]).endswith("/"):  # old tars mark directories by the slash alone
                t = _DIR
            if t in _NO_DATA:
                size = 0
            elif pax_size is not None:
                size = pax_size
            data_at = pos + BLOCK
            got = skip((size + BLOCK - 1) & ~(BLOCK - 1))
            if got < size:
                raise _Cut(f"cut short in the data of member {name!r} ({size} bytes at {self._at(data_at)})", name)
            pos = data_at + got  # a last member without its padding is read whole by tarfile
            member_at, start = start, None
            long_name = pax_name = pax_size = None
            yield member_at, name, t, data_at, size
        self.end = pos
        if start is not None:
            raise ValueError(f"{'end-of-archive block' if self.closed else 'cut short'} at {self._at(pos)}, after "
                             "a member's long-name header (GNU L or K, or pax x)")  # fmt: skip


class _Buffer:
    """Bytes in memory, read as ``_Reader`` reads a stream, so that ``Members`` walks both."""

    __slots__ = ("view", "at", "end")

    def __init__(self, view: memoryview) -> None:
        self.view, self.at, self.end = view, 0, len(view)

    def take(self, n: int) -> bytes:
        out = bytes(self.view[self.at : self.at + n])
        self.at += len(out)
        return out

    def skip(self, n: int) -> int:
        left = self.end - self.at
        if n > left:
            n = left
        self.at += n
        return n


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
    out: dict[str, bytes] = {}
    members = Members(_Buffer(view), len(view))
    try:
        for _, name, t, data_at, size in members:
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
        if members.closed:
            raise ValueError(f"end-of-archive block at byte {members.end} of the sample's {len(view)}")
    except ValueError as e:
        raise ShardError(shard, str(e), key) from None
    if not out:
        raise ShardError(shard, "no member of the sample in its byte range: the index does not match this shard", key)
    return out


class _Reader:
    """Sequential reads of a file object in large chunks, with the crc32 and count of every byte read."""

    __slots__ = ("f", "chunk", "buf", "at", "crc", "nread")

    def __init__(self, f: BinaryIO, chunk: int) -> None:
        self.f, self.chunk = f, chunk
        self.buf = b""
        self.at = 0  # position in buf
        self.crc = 0
        self.nread = 0

    def _more(self) -> bool:
        data = self.f.read(self.chunk)
        if not data:
            return False
        self.crc = zlib.crc32(data, self.crc)
        self.nread += len(data)
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
            done += len(data)
        return done

    def drain(self) -> None:
        """Read to the end of the file (for its size and crc)."""
        self.buf, self.at = b"", 0
        while True:
            data = self.f.read(self.chunk)
            if not data:
                return
            self.crc = zlib.crc32(data, self.crc)
            self.nread += len(data)


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
        shard = self.shard
        seen: set[str] = set()
        current = None
        exts: set[str] = set()
        members = Members(self._r)
        try:
            for start, name, t, _, _ in members:
                if t not in _REGULAR:
                    continue
                key, ext = split(name)
                if key is None:
                    continue
                if key != current:
                    if key in seen:
                        raise ShardError(shard, f"member {name!r} comes after other samples: a sample's members "
                                         "must be adjacent in its shard (webdataset reads them as two samples)",
                                         key)  # fmt: skip
                    seen.add(key)
                    current, exts = key, set()
                    yield key, start
                elif ext in exts:
                    raise ShardError(shard, f"member {name!r} repeats ext {ext!r} in its sample", key)
                exts.add(ext)
        except _Cut as e:
            raise ShardError(shard, str(e), split(e.name)[0] or current) from None
        except ValueError as e:
            raise ShardError(shard, str(e), current) from None
        # The last sample's range runs to the end-of-archive block: skipped members after it are in it, as they are
        # in the ranges of the samples they follow.
        self.end = members.end if current is not None else 0
        self._r.drain()
        self.size, self.crc = self._r.nread, self._r.crc
