"""fastfeed.io.shards' format layer: shard sources, the tar parser and scanner, the index and write_shards, with
round trips through the real webdataset package and tarfile."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import tarfile
import uuid
import zlib

import numpy as np
import pytest

from _shards import memfs  # noqa: F401 (a fixture, used by name)
from fastfeed.io.shards import index as index_mod
from fastfeed.io.shards import sources, tar
from fastfeed.io.shards.errors import ShardError
from fastfeed.io.shards.index import FILENAME, ShardIndex, index_shards
from fastfeed.io.shards.write import write_shards

pytestmark = pytest.mark.fastfeed_only


# -- helpers --------------------------------------------------------------------------------------


def _samples(n: int, size: int = 3000) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"jpg": rng.integers(0, 256, size + 37 * i, dtype=np.uint8).tobytes(), "cls": i % 7,
             "json": {"i": i}} for i in range(n)]  # fmt: skip


def _expected(sample: dict) -> dict:
    return {"jpg": sample["jpg"], "cls": str(sample["cls"]).encode(), "json": json.dumps(sample["json"]).encode()}


def _read_all(index: ShardIndex, storage_options=None) -> list[tuple[str, dict]]:
    """Every sample through the index and read_sample, reading only each sample's byte range."""
    out = []
    for i in range(index.n_samples):
        k, a, b = index.locate(i)
        url = index.urls[k]
        if "://" in url:
            fs, path = sources.filesystem(url, storage_options)
            buf = fs.cat_file(path, start=a, end=b)
        else:
            with open(url, "rb") as f:
                f.seek(a)
                buf = f.read(b - a)
        out.append((index.key(i), tar.read_sample(buf, url, index.key(i))))
    return out


def _tar_members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers() if m.isreg()]


def _memory_url() -> str:
    return f"memory://fastfeed-test-{uuid.uuid4().hex}"


class Folder:
    """ImageFolder-like: ``samples`` of (path, label); __getitem__ would decode, so write_shards must not call it."""

    def __init__(self, root) -> None:
        self.samples = []
        for i in range(6):
            p = os.path.join(root, f"c{i % 2}", f"img{i}.JPEG")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(os.urandom(500 + i))
            self.samples.append((p, i % 2))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        raise AssertionError("write_shards decoded a sample it could copy")


class Mapped:
    """A map-style dataset whose samples come from a function (module-level, so pool workers get it by fork)."""

    def __init__(self, n, make) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def _empty_at_3(i):
    return {} if i == 3 else {"txt": str(i)}


def _object_value(i):
    return {"txt": str(i), "obj": object()}


class _CountingFile:
    """A file object that records the size of every read, to prove the scanner streams."""

    def __init__(self, f, reads) -> None:
        self.f, self.reads = f, reads

    def read(self, n=-1):
        self.reads.append(n)
        return self.f.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


# -- sources --------------------------------------------------------------------------------------


def test_resolve_list_keeps_order_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    """A list comes back in its order, relative local paths made absolute and URLs untouched."""
    monkeypatch.chdir(tmp_path)
    got = sources.resolve(["b.tar", "s3://bucket/a.tar", tmp_path / "c.tar"])
    assert got == [str(tmp_path / "b.tar"), "s3://bucket/a.tar", str(tmp_path / "c.tar")]


def test_resolve_directory_lists_only_tar_files_sorted(tmp_path, memfs):
    """A local directory or an fsspec directory URL gives its *.tar files, sorted by name, nothing else."""
    for name in ("s-2.tar", "s-10.tar", "s-1.tar", "notes.txt", FILENAME):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "sub.tar").mkdir()
    assert sources.resolve(tmp_path) == [str(tmp_path / n) for n in ("s-1.tar", "s-10.tar", "s-2.tar")]
    root = _memory_url()
    for name in ("b.tar", "a.tar", "c.idx"):
        memfs.pipe(f"{root}/{name}", b"x")
    assert sources.resolve(root) == [f"{root}/a.tar", f"{root}/b.tar"]
    assert sources.resolve(root + "/") == [f"{root}/a.tar", f"{root}/b.tar"]


def test_brace_patterns_expand_as_webdataset_expands_them():
    """Brace patterns give braceexpand's (webdataset's) expansion: several braces, zero padding, steps, nesting."""
    braceexpand = pytest.importorskip("braceexpand").braceexpand
    patterns = ["shard-{000000..000011}.tar", "d/{train,val}/s-{00..02}-{a,b}.tar", "s{1..10..3}.tar",
                "s{09..11}.tar", "s{3..1}.tar", "x{a,{b,c}d}y", "{a..e..2}", "{a}", r"lit\{a,b\}", "{a,}z",
                "{-01..02}", "{{a,b}}", "{0..2}{}"]  # fmt: skip
    for p in patterns:
        assert sources.braceexpand(p) == list(braceexpand(p)), p
    assert sources.braceexpand("s-{000..999}.tar")[998] == "s-998.tar"


def test_resolve_brace_pattern_keeps_urls_and_absolutizes_paths(tmp_path, monkeypatch):
    """A brace pattern expands to URLs as written and to absolute local paths, without listing anything."""
    monkeypatch.chdir(tmp_path)
    assert sources.resolve("s3://b/{a,b}/s-{00..01}.tar") == ["s3://b/a/s-00.tar", "s3://b/a/s-01.tar",
                                                            "s3://b/b/s-00.tar", "s3://b/b/s-01.tar"]  # fmt: skip
    assert sources.resolve("x-{1..2}.tar") == [str(tmp_path / "x-1.tar"), str(tmp_path / "x-2.tar")]


def test_resolve_globs_and_single_paths(tmp_path, memfs):
    """A glob (local or fsspec URL) gives its matches sorted; a single path or URL gives itself."""
    for name in ("a-1.tar", "a-0.tar", "b-0.tar"):
        (tmp_path / name).write_bytes(b"x")
    assert sources.resolve(str(tmp_path / "a-*.tar")) == [str(tmp_path / "a-0.tar"), str(tmp_path / "a-1.tar")]
    assert sources.resolve(tmp_path / "b-0.tar") == [str(tmp_path / "b-0.tar")]
    root = _memory_url()
    for name in ("x-1.tar", "x-0.tar", "y-0.tar"):
        memfs.pipe(f"{root}/{name}", b"x")
    assert sources.resolve(f"{root}/x-*.tar") == [f"{root}/x-0.tar", f"{root}/x-1.tar"]
    assert sources.resolve(f"{root}/y-0.tar") == [f"{root}/y-0.tar"]
    assert sources.resolve(f"{root}/{{y,x}}-*.tar") == [f"{root}/y-0.tar", f"{root}/x-0.tar", f"{root}/x-1.tar"]
    assert sources.resolve(f"file://{tmp_path}/a-*.tar") == [f"file://{tmp_path}/a-0.tar",
                                                             f"file://{tmp_path}/a-1.tar"]  # fmt: skip


def test_resolve_errors_name_the_source(tmp_path, memfs):
    """An empty list, an empty directory, a glob matching nothing, a missing path, unbalanced braces and a non-path
    each raise a clear error naming what was given."""
    with pytest.raises(ValueError, match="empty"):
        sources.resolve([])
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=r"holds no \*\.tar files"):
        sources.resolve(tmp_path / "d")
    with pytest.raises(ValueError, match="matches no files"):
        sources.resolve(str(tmp_path / "none-*.tar"))
    with pytest.raises(FileNotFoundError, match="missing"):
        sources.resolve(tmp_path / "missing")
    with pytest.raises(ValueError, match="unbalanced braces"):
        sources.resolve("s-{0..3.tar}}")
    with pytest.raises(TypeError, match="int"):
        sources.resolve(7)
    with pytest.raises(TypeError, match="list items"):
        sources.resolve(["a.tar", 3])
    root = _memory_url()
    memfs.pipe(f"{root}/d/x.txt", b"x")
    with pytest.raises(ValueError, match=r"holds no \*\.tar"):
        sources.resolve(f"{root}/d")
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        sources.resolve(f"{root}/nothing-here")


# -- the tar parser and scanner -------------------------------------------------------------------


@pytest.fixture
def written(tmp_path):
    """Twelve samples written by write_shards into three shards."""
    data = _samples(12)
    urls = write_shards(data, tmp_path / "out", shard_bytes=20_000, num_workers=0, progress=False)
    return data, urls, tmp_path / "out"


def test_read_sample_returns_each_member_by_ext(written):
    """Each sample's byte range parses into exactly its members' bytes, keyed by ext."""
    data, urls, out = written
    index = ShardIndex.load(out)
    assert index.n_shards == len(urls) > 1
    got = _read_all(index)
    assert [k for k, _ in got] == [f"{i:09d}" for i in range(len(data))]
    assert [s for _, s in got] == [_expected(d) for d in data]


def _one_sample(written) -> tuple[bytes, str, str]:
    _, _, out = written
    index = ShardIndex.load(out)
    k, a, b = index.locate(1)
    with open(index.urls[k], "rb") as f:
        f.seek(a)
        return f.read(b - a), index.urls[k], index.key(1)


def test_read_sample_raises_naming_shard_and_key_on_a_cut_in_a_header(written):
    """A range cut inside a member's header raises ShardError with the shard, the key and where it was cut."""
    buf, url, key = _one_sample(written)
    first = len(tar.read_sample(buf, url, key)["jpg"])
    cut = 512 + ((first + 511) // 512) * 512 + 100  # 100 bytes into the second member's header
    with pytest.raises(ShardError, match="cut short in a header") as e:
        tar.read_sample(buf[:cut], url, key)
    assert (e.value.shard, e.value.key) == (url, key)
    assert url in str(e.value) and key in str(e.value)


def test_read_sample_raises_on_a_cut_in_a_members_data(written):
    """A range cut inside a member's data raises ShardError naming the member; nothing partial is returned."""
    buf, url, key = _one_sample(written)
    with pytest.raises(ShardError, match=r"cut short in the data of member '000000001\.") as e:
        tar.read_sample(buf[:2000], url, key)
    assert e.value.key == key


@pytest.mark.parametrize("at", [0, 100, 124, 148, 156, 300])
def test_read_sample_raises_on_a_flipped_header_byte(written, at):
    """One changed byte anywhere in a header (name, size, checksum, type...) fails its checksum: ShardError."""
    buf, url, key = _one_sample(written)
    bad = bytearray(buf)
    bad[at] ^= 0x01
    with pytest.raises(ShardError, match="damaged header") as e:
        tar.read_sample(bytes(bad), url, key)
    assert e.value.shard == url and e.value.key == key


def test_read_sample_rejects_a_range_of_another_sample(written):
    """A range whose members have another key (a stale index) raises rather than returning the wrong sample."""
    buf, url, _ = _one_sample(written)
    with pytest.raises(ShardError, match="belongs to sample '000000001'"):
        tar.read_sample(buf, url, "000000002")


def _long_tar(path, fmt) -> list[tuple[str, bytes]]:
    """A tar by Python's tarfile, in ``fmt``, with names over 100 chars, a directory, a symlink and a __meta__ file."""
    long_dir = "d" * 70 + "/" + "e" * 60
    members = [(f"{long_dir}/sample-0.jpg", b"a" * 700), (f"{long_dir}/sample-0.seg.png", b"b" * 5),
               ("short-1.txt", b"hello"), (f"{long_dir}/{'k' * 120}.cls", b"3"),
               ("ünï-2.json", b"{}")]  # fmt: skip
    with tarfile.open(path, "w", format=fmt) as t:
        d = tarfile.TarInfo(long_dir)
        d.type = tarfile.DIRTYPE
        t.addfile(d)
        meta = tarfile.TarInfo("__meta__")
        meta.size = 3
        t.addfile(meta, io.BytesIO(b"xyz"))
        for i, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
            if i == 1:
                link = tarfile.TarInfo(f"{long_dir}/link-{'l' * 90}.jpg")
                link.type, link.linkname = tarfile.SYMTYPE, "x" * 150
                t.addfile(link)
    return members


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_tarfile_written_long_names_parse(tmp_path, fmt):
    """tarfile's GNU (L), pax (x) and ustar (prefix) long names, >100 chars, index and read back; directories,
    links and __meta__ members are skipped, as webdataset skips them."""
    long_dir = "d" * 70 + "/" + "e" * 60
    if fmt == tarfile.USTAR_FORMAT:  # ustar cannot hold a 120-char base name or non-ASCII in every tool: keep to it
        path = tmp_path / "u.tar"
        with tarfile.open(path, "w", format=fmt) as t:
            for name, data in ((f"{long_dir}/s-0.jpg", b"a" * 600), (f"{long_dir}/s-0.cls", b"1")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        got = _read_all(index_shards([path]))
        assert got == [(f"{long_dir}/s-0", {"jpg": b"a" * 600, "cls": b"1"})]
        return
    path = tmp_path / "long.tar"
    _long_tar(path, fmt)
    got = dict(_read_all(index_shards([path])))
    assert got == {f"{long_dir}/sample-0": {"jpg": b"a" * 700, "seg.png": b"b" * 5},
                   "short-1": {"txt": b"hello"}, f"{long_dir}/{'k' * 120}": {"cls": b"3"},
                   "ünï-2": {"json": b"{}"}}  # fmt: skip


def test_read_sample_raises_when_cut_after_a_long_name_header(tmp_path):
    """A range that ends after a member's GNU long-name header, before the member itself, raises: the sample's
    first members alone are never returned as the whole sample."""
    key = "k" * 150
    _tar_of(tmp_path / "l.tar", [(f"{key}.jpg", b"a" * 10), (f"{key}.cls", b"1")])
    index = index_shards([tmp_path / "l.tar"])
    raw = open(tmp_path / "l.tar", "rb").read()
    assert tar.read_sample(raw[: index.offsets[1]], "l.tar", key) == {"jpg": b"a" * 10, "cls": b"1"}
    with tarfile.open(tmp_path / "l.tar") as t:
        cls = t.getmembers()[1]
    cut = cls.offset_data - 512  # the .cls member's own header: its long-name header and name block come before
    assert cut > cls.offset
    with pytest.raises(ShardError, match="long-name header"):
        tar.read_sample(raw[:cut], "l.tar", key)


def test_scanner_streams_in_chunks_with_the_files_crc(written, tmp_path):
    """The scanner reads a shard once in bounded chunks (tiny ones cross every boundary), and finds the same sample
    offsets, end, size and crc32 whatever the chunk size."""
    _, urls, _ = written
    results = []
    for chunk in (tar.CHUNK, 1000, 511, 7):
        reads = []
        with _CountingFile(open(urls[0], "rb", buffering=0), reads) as f:
            scan = tar.Scan(f, urls[0], chunk=chunk)
            samples = list(scan.samples())
        assert reads and all(0 < n <= chunk for n in reads)
        raw = open(urls[0], "rb").read()
        assert (scan.size, scan.crc) == (len(raw), zlib.crc32(raw))
        results.append((samples, scan.end))
    assert all(r == results[0] for r in results)
    # The offsets are tarfile's: each sample starts at its first member's header.
    with tarfile.open(urls[0]) as t:
        firsts = [m.offset for m in t.getmembers() if m.name.endswith(".jpg")]
    assert [at for _, at in results[0][0]] == firsts


def _tar_of(path, members) -> None:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def test_scanner_rejects_a_key_that_comes_back_and_a_repeated_ext(tmp_path):
    """A key seen again after another sample, or an ext twice in one sample, raises ShardError naming the shard and
    the key (webdataset would read them as other samples)."""
    _tar_of(tmp_path / "split.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.cls", b"3")])
    with pytest.raises(ShardError, match="must be adjacent") as e:
        index_shards([tmp_path / "split.tar"])
    assert e.value.shard == str(tmp_path / "split.tar") and e.value.key == "a"
    _tar_of(tmp_path / "dup.tar", [("a.jpg", b"1"), ("a.JPG", b"2")])
    with pytest.raises(ShardError, match="repeats ext 'jpg'") as e:
        index_shards([tmp_path / "dup.tar"])
    assert e.value.key == "a"


def test_index_shards_raises_on_a_truncated_or_missing_shard(written, tmp_path):
    """A shard cut in a header or in a member's data, or missing, raises ShardError naming it."""
    _, urls, _ = written
    raw = open(urls[0], "rb").read()
    with tarfile.open(urls[0]) as t:
        first, second = t.getmembers()[:2]
    for cut, detail in ((second.offset + 100, "cut short in a header"),
                        (first.offset_data + 100, "cut short in the data of member '000000000.jpg'")):  # fmt: skip
        bad = tmp_path / f"cut-{cut}.tar"
        bad.write_bytes(raw[:cut])
        with pytest.raises(ShardError, match=detail) as e:
            index_shards([bad])
        assert e.value.shard == str(bad) and e.value.key == "000000000"
    with pytest.raises(ShardError, match="not found") as e:
        index_shards([tmp_path / "gone.tar"])
    assert e.value.shard == str(tmp_path / "gone.tar")


# -- headers about other members: GNU L and K, pax x and g ----------------------------------------

_LINK = "t" * 150  # a link target over ustar's 100 chars: GNU writes it in a K header, pax in an x header


def _add(t, name, data=b"", kind=tarfile.REGTYPE, linkname="", **pax) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.pax_headers = kind, linkname, len(data), pax
    t.addfile(info, io.BytesIO(data))


def _gnu_links_tar(path) -> None:
    """GNU format: K headers (long link names) before a symlink, a hardlink and, since tarfile writes one for any
    member with a long linkname, before the regular file that starts sample ``b``; L headers (long names) too."""
    long_key = "d" * 120
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
        _add(t, "a.jpg", b"1" * 700)
        _add(t, f"{long_key}/a.lnk", kind=tarfile.SYMTYPE, linkname=_LINK)  # K, L, then the symlink
        _add(t, "a.cls", b"0")
        _add(t, "b.hard.jpg", kind=tarfile.LNKTYPE, linkname=_LINK)  # between samples a and b
        _add(t, "b.jpg", b"2" * 513, linkname=_LINK)
        _add(t, "b.cls", b"1")
        _add(t, f"{long_key}.jpg", b"3" * 100, linkname=_LINK)  # K, L, then the member
        _add(t, f"{long_key}.txt", b"c")


def _pax_globals_tar(path) -> None:
    """pax format with g headers where tarfile writes them: first (pax_headers= on TarFile), and where a TarFile
    opened with mode "a" starts (inside sample ``a``, and between samples ``b`` and ``c``); x headers for a long name,
    a long link name and a fractional mtime."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "first"}) as t:
        _add(t, "a.jpg", b"1" * 700, mtime="1.5")
    with tarfile.open(path, "a", format=tarfile.PAX_FORMAT, pax_headers={"comment": "inside a"}) as t:
        _add(t, "a.cls", b"0")
        _add(t, "a.lnk", kind=tarfile.SYMTYPE, linkname=_LINK)
        _add(t, f"{'e' * 120}/b.jpg", b"2" * 512)
        _add(t, f"{'e' * 120}/b.cls", b"1", mtime="2.5")
    with tarfile.open(path, "a", format=tarfile.PAX_FORMAT, pax_headers={"comment": "between b and c"}) as t:
        _add(t, "c.jpg", b"3" * 1000, mtime="3.5")
        _add(t, "c.cls", b"2")


def _spliced_tar(path) -> None:
    """A g header between a member's x header and the member (valid pax, as tarfile reads it): the x header (a
    ``size`` record for ``b``, an ``mtime`` one for ``c``) still belongs to that member."""
    glob = tarfile.TarInfo.create_pax_global_header({"comment": "between"})
    parts = []
    for name, data, pax in (("a.jpg", b"1" * 700, {}), ("b.jpg", b"2" * 300, {"size": "300"}),
                            ("c.jpg", b"3" * 10, {"mtime": "4.5"})):  # fmt: skip
        info = tarfile.TarInfo(name)
        info.size, info.pax_headers = len(data), pax
        head = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if pax:
            assert len(head) == 3 * 512  # the x header, its records, the member's own header
            head = head[:1024] + glob + head[1024:]
        parts += [head, data, bytes(-len(data) % 512)]
    with open(path, "wb") as f:
        f.write(b"".join(parts) + bytes(1024))


def _by_tarfile(path) -> tuple[list[tuple[str, int, dict]], int]:
    """The samples as tarfile reads the tar: ``(key, offset of the first member's first header, {ext: bytes})``,
    and where its members end (its end-of-archive block)."""
    samples = []
    with tarfile.open(path) as t:
        for m in t.getmembers():
            key, ext = tar.split(m.name)
            if not m.isreg() or key is None:
                continue
            if not samples or samples[-1][0] != key:
                samples.append((key, m.offset, {}))
            samples[-1][2][ext] = t.extractfile(m).read()
        return samples, t.offset


@pytest.mark.parametrize("make", [_gnu_links_tar, _pax_globals_tar, _spliced_tar])
def test_scanner_and_reader_agree_with_tarfile_around_k_and_g_headers(tmp_path, make):
    """read_sample reads each range the scanner finds (at any chunk size) into tarfile's bytes, and the ranges
    start at tarfile's offsets: a K header is counted in the member after it, and a g header in none."""
    path = tmp_path / "t.tar"
    make(path)
    want, end = _by_tarfile(path)
    assert len(want) == 3
    raw = path.read_bytes()
    for chunk in (tar.CHUNK, 511, 7):
        scan = tar.Scan(io.BytesIO(raw), str(path), chunk=chunk)
        found = list(scan.samples())
        bounds = [at for _, at in found] + [scan.end]
        got = [(k, tar.read_sample(raw[bounds[i] : bounds[i + 1]], str(path), k)) for i, (k, _) in enumerate(found)]
        assert got == [(k, d) for k, _, d in want]
        assert found == [(k, at) for k, at, _ in want]
        assert (scan.end, scan.size) == (end, len(raw))


@pytest.mark.parametrize("make", [_gnu_links_tar, _pax_globals_tar, _spliced_tar])
def test_members_are_tarfiles_members(tmp_path, make):
    """The one header walk yields tarfile's members, links included, each once with its name, type, first header
    and data: an L, K, x or g header is never a member, and a K's link name never a member's name."""
    path = tmp_path / "t.tar"
    make(path)
    raw = path.read_bytes()
    with tarfile.open(path) as t:
        want = [(m.offset, m.name, m.type, t.extractfile(m).read() if m.isreg() else b"") for m in t.getmembers()]
        end = t.offset
    assert any(m[2] == tarfile.SYMTYPE for m in want) or make is _spliced_tar
    members = tar.Members(tar._Buffer(memoryview(raw)))
    got = [(start, name, bytes([t]), raw[at : at + size]) for start, name, t, at, size in members]
    assert got == want
    assert members.closed and members.end == end


@pytest.mark.parametrize("record", ["path", "size"])
def test_a_global_pax_header_that_names_or_sizes_members_is_refused(tmp_path, record):
    """A g header's path or size applies to every member after it (tarfile gives them all its value), which a
    sample's range cannot see: the scanner and read_sample both refuse it, naming the header."""
    path = tmp_path / "g.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        _add(t, "a.jpg", b"1" * 700)
    value = "everything.jpg" if record == "path" else "3"
    with tarfile.open(path, "a", format=tarfile.PAX_FORMAT, pax_headers={record: value}) as t:
        _add(t, "a.cls", b"0")
        _add(t, "b.jpg", b"2")
    with tarfile.open(path) as t:
        members = t.getmembers()
        b_at = members[2].offset
    assert [str(getattr(m, record)) for m in members[1:]] == [value, value]
    detail = rf"global pax header at byte 1536( of the sample's \d+)? sets {record} "
    with pytest.raises(ShardError, match=detail) as e:
        index_shards([path])
    assert e.value.key == "a"
    with pytest.raises(ShardError, match=detail) as e:
        tar.read_sample(path.read_bytes()[:b_at], str(path), "a")
    assert e.value.key == "a"


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_read_sample_raises_when_cut_after_a_link_name_header(tmp_path, fmt):
    """A range that ends after the K (GNU) or x (pax) header holding a member's long link name, before the member,
    raises as one cut after a long-name header does: that header belongs to the member after it."""
    path = tmp_path / "k.tar"
    with tarfile.open(path, "w", format=fmt) as t:
        _add(t, "a.jpg", b"1" * 700)
        _add(t, "a.cls", b"0", linkname=_LINK)
    with tarfile.open(path) as t:
        cls = t.getmember("a.cls")
        end = t.offset
    raw = path.read_bytes()
    assert tar.read_sample(raw[:end], "k.tar", "a") == {"jpg": b"1" * 700, "cls": b"0"}
    cut = cls.offset_data - 512  # a.cls's own header: its link name's header and records come before
    assert cut > cls.offset
    with pytest.raises(ShardError, match="long-name header"):
        tar.read_sample(raw[:cut], "k.tar", "a")


@pytest.mark.parametrize("size", ["-512", "1_0", " 10"])
def test_a_pax_size_that_is_not_a_plain_number_is_refused(tmp_path, size):
    """A pax size record that int() would take but no tar reader means ("-512" would step back onto the header)
    raises ShardError in the scanner and the reader, naming the record."""
    path = tmp_path / "x.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as t:
        _add(t, "a.jpg", b"1" * 700)
        _add(t, "a.cls", b"0" * 10, size=size)  # tarfile writes the record as given
    raw = path.read_bytes()
    assert f" size={size}\n".encode() in raw[2048:2560]
    with pytest.raises(ShardError, match=rf"pax header at byte 1536: bad size '{size}'") as e:
        index_shards([path])
    assert e.value.key == "a"
    with pytest.raises(ShardError, match="bad size"):
        tar.read_sample(raw[:-1024], str(path), "a")


# -- the index ------------------------------------------------------------------------------------


def test_index_arrays_and_locate_agree_with_the_tars(written):
    """counts, starts, offsets, sizes and crcs describe the shards; locate/key map a global id to its range; ids out
    of range raise IndexError."""
    data, urls, out = written
    index = index_shards(out)
    assert index.urls == urls and index.n_samples == len(data) == int(index.starts[-1])
    assert index.offsets.shape == (index.n_samples + index.n_shards,)
    for k, url in enumerate(urls):
        raw = open(url, "rb").read()
        assert (int(index.sizes[k]), int(index.crcs[k])) == (len(raw), zlib.crc32(raw))
        names = [n for n, _ in _tar_members(url)]
        assert int(index.counts[k]) == len(names) // 3
        assert int(index.starts[k + 1] - index.starts[k]) == int(index.counts[k])
        assert index.shard_offsets(k)[-1] == len(raw) - 1024  # the end-of-archive blocks are no sample's
    k, a, b = index.locate(int(index.starts[1]))
    assert (k, a) == (1, 0) and b > a
    with pytest.raises(IndexError):
        index.locate(len(data))
    with pytest.raises(IndexError):
        index.key(-1)
    again = pickle.loads(pickle.dumps(index))
    assert again == index and again.fingerprint == index.fingerprint
    assert index.keys == [f"{i:09d}" for i in range(len(data))]


def test_index_shards_reads_each_shard_once_and_saves_beside_them(written, monkeypatch):
    """index_shards opens each shard once, in threads, and dest=True writes fastfeed-index.json beside them, equal to
    the one write_shards wrote."""
    _, urls, out = written
    written_index = ShardIndex.load(out)
    os.unlink(out / FILENAME)
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(index_mod, "open", counting_open, raising=False)
    index = index_shards(out, dest=True, num_threads=3, progress=True)
    monkeypatch.undo()
    assert sorted(p for p in opened if p.endswith(".tar")) == sorted(urls)
    assert (out / FILENAME).exists() and ShardIndex.load(out / FILENAME) == index == written_index


def test_index_file_is_versioned_json_with_relative_urls_and_moves_with_its_shards(written, tmp_path):
    """The index file is the documented JSON, shards beside it are stored relative, so the set can be moved; a
    different format or a newer version is refused clearly."""
    _, urls, out = written
    doc = json.loads((out / FILENAME).read_text())
    assert (doc["format"], doc["version"]) == ("fastfeed-shard-index", 1)
    assert [s["url"] for s in doc["shards"]] == [os.path.basename(u) for u in urls]
    assert set(doc["shards"][0]) == {"url", "size", "crc32", "first", "lengths", "keys"}
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    index = ShardIndex.load(moved)
    assert index.urls == [str(moved / os.path.basename(u)) for u in urls]
    assert len(_read_all(index)) == index.n_samples
    elsewhere = index.save(tmp_path / "elsewhere.json")
    assert [s["url"] for s in json.loads(open(elsewhere).read())["shards"]] == ["moved/" + os.path.basename(u)
                                                                                for u in urls]  # fmt: skip
    apart = tmp_path / "apart"
    apart.mkdir()
    far = json.loads(open(index.save(apart / "x.json")).read())
    assert [s["url"] for s in far["shards"]] == index.urls  # not beside it: absolute
    for change, match in (({"version": 2}, "version 2"), ({"format": "other"}, "not a fastfeed shard index")):
        (tmp_path / "bad.json").write_text(json.dumps({**doc, **change}))
        with pytest.raises(ValueError, match=match):
            ShardIndex.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="index_shards"):
        ShardIndex.load(tmp_path / "nothing.json")


def test_subset_is_the_index_of_those_shards_in_that_order(written):
    """subset(urls) gives the index of just those shards, in the order given, whose samples read back the same."""
    _, urls, out = written
    index = ShardIndex.load(out)
    part = index.subset([urls[2], urls[0]])
    assert part.urls == [urls[2], urls[0]]
    assert list(part.counts) == [index.counts[2], index.counts[0]]
    keys = index.shard_keys(2) + index.shard_keys(0)
    assert [k for k, _ in _read_all(part)] == keys
    assert dict(_read_all(part)) == {k: s for k, s in _read_all(index) if k in set(keys)}
    with pytest.raises(ValueError, match="not in this index"):
        index.subset([urls[0], "elsewhere.tar"])


def test_fingerprint_names_the_content_not_the_place(written, tmp_path):
    """The fingerprint is the same for a copy elsewhere and differs when a shard's bytes differ."""
    _, urls, out = written
    a = index_shards(out)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert index_shards(copy).fingerprint == a.fingerprint
    raw = bytearray(open(copy / os.path.basename(urls[0]), "rb").read())
    raw[600] ^= 0xFF  # a data byte: same sizes and counts, another crc
    (copy / os.path.basename(urls[0])).write_bytes(bytes(raw))
    assert index_shards(copy).fingerprint != a.fingerprint
    assert len(a.fingerprint) == 64


def test_index_saves_and_loads_through_an_fsspec_url(written, memfs):
    """Shards copied to an fsspec store are indexed there, the index saved beside them and loaded by URL, with
    relative URLs resolved to the store's."""
    _, urls, _ = written
    root = _memory_url()
    for u in urls:
        memfs.pipe(f"{root}/{os.path.basename(u)}", open(u, "rb").read())
    index = index_shards(root, dest=True, num_threads=2)
    assert index.urls == [f"{root}/{os.path.basename(u)}" for u in urls]
    doc = json.loads(memfs.cat(f"{root}/{FILENAME}"))
    assert doc["shards"][0]["url"] == os.path.basename(urls[0])
    loaded = ShardIndex.load(root)
    assert loaded == index and ShardIndex.load(f"{root}/{FILENAME}") == index
    assert _read_all(loaded) == _read_all(index_shards(urls))


# -- write_shards ---------------------------------------------------------------------------------


def test_write_shards_is_deterministic_with_fixed_headers(tmp_path):
    """The same dataset gives byte-identical shards through processes and threads, with mtime 0, uid/gid 0 and mode
    0o444 in every header, and shards end before shard_bytes."""
    data = _samples(30)
    a = write_shards(data, tmp_path / "a", shard_bytes=40_000, num_workers=2, chunksize=4, progress=False)
    b = write_shards(data, tmp_path / "b", shard_bytes=40_000, num_workers=0, chunksize=7, progress=False)
    assert len(a) == len(b) > 2
    for x, y in zip(a, b):
        assert open(x, "rb").read() == open(y, "rb").read()
        assert os.path.getsize(x) <= 40_000
    with tarfile.open(a[0]) as t:
        assert {(m.mtime, m.uid, m.gid, m.mode) for m in t.getmembers()} == {(0, 0, 0, 0o444)}
    assert (tmp_path / "a" / FILENAME).read_bytes() != b""
    assert not [p for p in os.listdir(tmp_path / "a") if ".tmp" in p]


def test_write_shards_refuses_a_dest_with_shards_unless_overwrite(tmp_path):
    """A dest holding shards or an index is refused; overwrite=True replaces them and removes old shards it did not
    rewrite, so a directory source finds only the new set."""
    urls = write_shards(_samples(20), tmp_path, shard_bytes=15_000, num_workers=0, progress=False)
    with pytest.raises(ValueError, match="overwrite=True"):
        write_shards(_samples(2), tmp_path, num_workers=0, progress=False)
    new = write_shards(_samples(2), tmp_path, num_workers=0, progress=False, overwrite=True)
    assert len(urls) > 1 and len(new) == 1
    assert sources.resolve(tmp_path) == new
    assert ShardIndex.load(tmp_path).n_samples == 2


def test_write_shards_errors_are_clear(tmp_path):
    """A sample that encodes to nothing, an ext holding '/', a value it cannot encode, a non-dict sample, duplicate
    keys and an empty dataset each raise, naming the sample; no partial shard is left."""
    with pytest.raises(ValueError, match="sample 3 .*encodes to nothing"):
        write_shards(Mapped(6, _empty_at_3), tmp_path / "e", num_workers=2, progress=False, chunksize=2)
    assert not [p for p in os.listdir(tmp_path / "e")]
    with pytest.raises(ValueError, match="'a/b'.*no '/'"):
        write_shards([{"a/b": b"x"}], tmp_path / "s", num_workers=0, progress=False)
    with pytest.raises(TypeError, match="'obj' is a object.*encode="):
        write_shards(Mapped(3, _object_value), tmp_path / "t", num_workers=2, progress=False)
    with pytest.raises(TypeError, match="sample 0 is a tuple"):
        write_shards([(b"x", 1)], tmp_path / "u", num_workers=0, progress=False)
    with pytest.raises(ValueError, match="share the key 'k'"):
        write_shards([{"__key__": "k", "a": b"1"}, {"__key__": "k", "a": b"2"}], tmp_path / "v", num_workers=0,
                     progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="does not read back"):
        write_shards([{"__key__": "a.b", "x": b"1"}], tmp_path / "w", num_workers=0, progress=False)
    with pytest.raises(ValueError, match="empty"):
        write_shards([], tmp_path / "x", progress=False)


def test_default_encoding_of_values(tmp_path):
    """The default encoding writes bytes as-is, str as UTF-8, numbers as text, dict/list as JSON, numpy arrays as
    .npy and PIL images in the format their ext names."""
    pil = pytest.importorskip("PIL.Image")
    img = pil.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    sample = {"bin": b"\x00\x01", "txt": "héllo", "cls": 3, "f": 1.5, "json": {"a": [1]}, "lst": [1, 2],
              "npy": arr, "png": img, "__extra__": "skipped"}  # fmt: skip
    write_shards([sample], tmp_path, num_workers=0, progress=False)
    (_, got), = _read_all(ShardIndex.load(tmp_path))
    assert set(got) == {"bin", "txt", "cls", "f", "json", "lst", "npy", "png"}
    assert (got["bin"], got["txt"], got["cls"], got["f"]) == (b"\x00\x01", "héllo".encode(), b"3", b"1.5")
    assert json.loads(got["json"]) == {"a": [1]} and json.loads(got["lst"]) == [1, 2]
    assert np.array_equal(np.load(io.BytesIO(got["npy"])), arr)
    back = pil.open(io.BytesIO(got["png"]))
    assert back.format == "PNG" and np.array_equal(np.asarray(back), np.asarray(img))


def test_imagefolder_like_dataset_is_copied_not_decoded(tmp_path):
    """A dataset with ``samples`` of (path, label) is written as each file's own bytes (ext lowercased) and its
    label, without calling __getitem__."""
    ds = Folder(tmp_path / "tree")
    write_shards(ds, tmp_path / "out", num_workers=2, progress=False)
    got = _read_all(ShardIndex.load(tmp_path / "out"))
    assert [s for _, s in got] == [{"jpeg": open(p, "rb").read(), "cls": str(y).encode()} for p, y in ds.samples]


def test_write_shards_to_fsspec_urls(memfs, tmp_path):
    """A memory:// or file:// dest gets the shards and the index beside them, readable back by URL."""
    data = _samples(9)
    root = _memory_url()
    urls = write_shards(data, root, shard_bytes=15_000, num_workers=0, progress=False)
    assert urls == [f"{root}/shard-{k:06d}.tar" for k in range(len(urls))] and len(urls) > 1
    assert memfs.exists(f"{root}/{FILENAME}")
    index = ShardIndex.load(root)
    assert index.urls == urls
    assert [s for _, s in _read_all(index)] == [_expected(d) for d in data]
    with pytest.raises(ValueError, match="overwrite=True"):
        write_shards(data, root, num_workers=0, progress=False)
    file_urls = write_shards(data, f"file://{tmp_path}/f", num_workers=0, progress=False)
    assert file_urls[0].startswith("file://") and os.path.exists(tmp_path / "f" / FILENAME)
    assert [s for _, s in _read_all(ShardIndex.load(f"file://{tmp_path}/f"))] == [_expected(d) for d in data]


def test_write_shards_progress_bar(tmp_path, capsys):
    """progress=True shows a tqdm bar over the samples."""
    write_shards(_samples(3), tmp_path, num_workers=0, progress=True)
    assert "writing shards" in capsys.readouterr().err


# -- webdataset both ways -------------------------------------------------------------------------


def test_webdataset_reads_write_shards_output(tmp_path):
    """webdataset.WebDataset reads write_shards' shards as-is: the same keys and bytes, in order, each from the shard
    the index names."""
    wds = pytest.importorskip("webdataset")
    data = _samples(25)
    urls = write_shards(data, tmp_path, shard_bytes=30_000, num_workers=2, progress=False)
    got = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in got] == [f"{i:09d}" for i in range(len(data))]
    assert [{k: v for k, v in s.items() if not k.startswith("__")} for s in got] == [_expected(d) for d in data]
    index = ShardIndex.load(tmp_path)
    assert [s["__url__"] for s in got] == [index.urls[index.locate(i)[0]] for i in range(len(data))]


def test_shards_written_by_webdataset_index_and_read_back(tmp_path):
    """Shards from webdataset's ShardWriter and TarWriter are indexed by index_shards, and every sample read back
    with read_sample equals what was written."""
    wds = pytest.importorskip("webdataset")
    rng = np.random.default_rng(1)
    written = [{"__key__": f"dir/s{i:04d}", "jpg": rng.integers(0, 256, 1500 + 50 * i, dtype=np.uint8).tobytes(),
                "cls": str(i), "seg.png": b"p" * i} for i in range(20)]  # fmt: skip
    with wds.ShardWriter(str(tmp_path / "w-%03d.tar"), maxcount=6, verbose=0) as sink:
        for s in written:
            sink.write(s)
    with wds.TarWriter(str(tmp_path / "t.tar")) as sink:
        for s in written[:5]:
            sink.write(s)
    expected = [(s["__key__"], {"jpg": s["jpg"], "cls": s["cls"].encode(), "seg.png": s["seg.png"]})
                for s in written]  # fmt: skip
    index = index_shards(str(tmp_path / "w-{000..003}.tar"), dest=tmp_path / "w.json")
    assert list(index.counts) == [6, 6, 6, 2]
    assert _read_all(index) == expected
    assert _read_all(ShardIndex.load(tmp_path / "w.json")) == expected
    assert _read_all(index_shards([tmp_path / "t.tar"])) == expected[:5]


def test_the_docs_shard_writing_example_runs_without_torchvision(tmp_path, monkeypatch):
    """The Shards page's example of writing an image folder into shards imports no torchvision (no extra installs
    it) and, pointed at a small folder and a local destination, writes shards Shards reads back with their classes."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "shards.md").read_text()
    section = page[page.index("## Writing shards"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert not re.search(r"^\s*(from|import) torchvision", code, re.M)
    for c, name in enumerate(("cat", "dog")):
        os.makedirs(tmp_path / "imgs" / name)
        for i in range(3):
            (tmp_path / "imgs" / name / f"{i}.jpg").write_bytes(bytes([c, i]) * 500)
    code = code.replace('"/data/imagenet/train"', repr(str(tmp_path / "imgs")))
    code = code.replace('"s3://bucket/imagenet/train/"', repr(str(tmp_path / "out") + "/"))
    code = code.replace("num_workers=8", "num_workers=0")
    exec(compile(code, "docs/guide/shards.md", "exec"), {})
    from fastfeed.io import Shards

    got = [(s["jpg"][:2], s["cls"]) for s in Shards(str(tmp_path / "out"), batch_size=1)]
    assert got == [(bytes([c, i]), str(c).encode()) for c in range(2) for i in range(3)]
