"""A shard index is read as hostile input: damaged or hostile indexes end in a ValueError naming the
index and the field, in a ShardError naming a shard of the set, or in the clean epoch; never in a MemoryError, a
RecursionError, a hang or bytes from outside the set. The readings that could take a process down run in a child
under an address-space cap (``_index_hostile``); the url rule, the nesting scan and the indexes fastfeed writes are
checked here."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _index_hostile as hostile
from _shards import memfs  # noqa: F401 (a fixture, used by name)
from fastfeed.io import ShardError, ShardIndex, Shards, index_shards, write_shards
from fastfeed.io.shards import index_check

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    hostile.make_sets(str(root))
    return str(root)


def _child(what: str, spec: dict, tmp_path, timeout: float):
    """Run ``_index_hostile.py what`` on ``spec``; returns (its exit status, its JSON lines, its stderr's end)."""
    spec_file = tmp_path / f"{what}.json"
    spec_file.write_text(json.dumps(spec))
    try:
        proc = subprocess.run([sys.executable, os.path.join(TESTS, "_index_hostile.py"), what, str(spec_file)],
                              capture_output=True, text=True, timeout=timeout, cwd=tmp_path)  # fmt: skip
    except subprocess.TimeoutExpired as e:  # run() has killed and reaped it
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        last = [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1:]
        pytest.fail(f"the child hung: still running after {timeout} s; last line: {last}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines, proc.stderr[-3000:]


@pytest.mark.hang_limit(170)
def test_fifty_one_damaged_or_hostile_indexes_each_end_in_a_named_error_or_the_clean_epoch(sets, tmp_path):
    """The review's list, read whole in a child capped at 2 GiB above its imports: bad lengths (10**18, 1e300,
    negative, not integers), sizes, firsts and crc32s, keys (not strings, a lone surrogate, 100 MB), urls outside the
    set (``../``, absolute, ``file://``, another host), the file cut, a byte flipped, 200,000-deep nesting, a million
    empty shards. Each ends as the case says: a ValueError naming the index and the field, a ShardError naming a
    shard of the set and the sample, or an epoch in which every sample is the set's, byte for byte."""
    names = [name for name, _, _ in hostile.CASES]
    rc, lines, err = _child("cases", {"root": sets, "cases": names}, tmp_path, timeout=150)
    results = {line["case"]: line for line in lines if "case" in line}
    started = [line["starts"] for line in lines if "starts" in line]
    assert rc == 0 and len(results) == len(names), (
        f"the child ended with status {rc} while reading {started[-1:]}: {err}")  # fmt: skip
    problems = []
    for name, _, (end, expected) in hostile.CASES:
        got = results[name]
        why = hostile.acceptable(got, got["index"], sets)
        if why is not None:
            problems.append(f"{name}: {why}")
        elif got["end"] != end:
            problems.append(f"{name}: ended in {got['end']}, expected {end}: {got}")
        elif end == "epoch" and got["samples"] != expected:
            problems.append(f"{name}: an epoch of {got['samples']} samples, expected {expected}")
        elif end != "epoch" and not re.search(expected, got["message"]):
            problems.append(f"{name}: {got['message']!r} does not match {expected!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.hang_limit(170)
def test_fuzzed_indexes_end_in_a_named_error_or_the_clean_epoch(sets, tmp_path):
    """Hypothesis mutates the good index (any JSON value put in any field or list element, bytes flipped, the file
    cut short), 300 examples read whole in a capped child: each ends as ``_index_hostile.acceptable`` allows."""
    rc, lines, err = _child("fuzz", {"root": sets, "examples": 300}, tmp_path, timeout=150)
    assert rc == 0 and {"fuzz": "passed", "examples": 300} in lines, f"status {rc}: {err}"


@pytest.mark.xfail(strict=True, reason="a gap of the reader, not of the index's checks: it reads no byte past a "
                   "sample's range, so a shard's last sample cut by whole members reads as a smaller sample")
def test_a_shards_last_sample_cut_by_a_whole_member_is_refused(sets):
    """An index whose shard's last length is one member short (its ranges still fit the shard) should end in a
    ShardError for that sample; today the sample arrives without its last member. The block after the last range is
    the end-of-archive's zeros in a whole index, and would tell."""
    doc = json.loads(hostile.index_text(sets))
    doc["shards"][0]["lengths"][-1] -= hostile.MEMBER
    path = os.path.join(sets, hostile.SET, "trimmed.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    try:
        with pytest.raises(ShardError, match=r"shard-000000\.tar, sample 's000004'"):
            list(Shards(os.path.join(sets, hostile.SET), index=path))
    finally:
        os.unlink(path)


# -- the url rule -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url,base,resolved", [
    ("a.tar", "/d/set", "/d/set/a.tar"),
    ("train/a.tar", "/d/set", "/d/set/train/a.tar"),
    ("./a.tar", "/d/set", "/d/set/a.tar"),
    ("..a.tar", "/d/set", "/d/set/..a.tar"),  # a name that starts with dots is a name
    ("/d/set/a.tar", "/d/set", "/d/set/a.tar"),  # absolute, and below the index's directory
    ("file:///d/set/a.tar", "/d/set", "file:///d/set/a.tar"),
    ("/d/set/a.tar", "file:///d/set", "/d/set/a.tar"),
    ("s3://b/set/x/a.tar", "s3://b/set", "s3://b/set/x/a.tar"),
    ("a.tar", "https://host/set", "https://host/set/a.tar"),
    ("a%20b.tar", "https://host/set", "https://host/set/a%20b.tar"),
    ("../a.tar", "/d/set", None),
    ("x/../../a.tar", "/d/set", None),
    ("..", "/d/set", None),
    ("/d/other/a.tar", "/d/set", None),
    ("/d/set/../other/a.tar", "/d/set", None),
    ("/d/settle/a.tar", "/d/set", None),  # a prefix of the name is not the directory
    ("file:///d/other/a.tar", "/d/set", None),
    ("file:///etc/passwd", "file:///d/set", None),
    ("https://evil/set/a.tar", "https://host/set", None),
    ("s3://c/set/a.tar", "s3://b/set", None),
    ("s3://b/set/../x/a.tar", "s3://b/set", None),
    ("%2e%2e/a.tar", "https://host/set", None),  # an HTTP server reads %2e%2e as ..
    ("x/%2E%2E/%2e%2e/a.tar", "https://host/set", None),
    ("..\\a.tar", "/d/set", None),
    ("a\x00.tar", "/d/set", None),
    ("/a.tar", None, None),  # no directory known: only relative names
    ("a.tar", None, "a.tar"),
])  # fmt: skip
def test_a_shard_url_is_read_only_below_the_indexs_directory(url, base, resolved):
    """resolve_url: where a url is when it is below the index's directory, else None (refused unless the caller
    opts in); from_json agrees, naming the field and the opt-in."""
    assert index_check.resolve_url(url, base) == resolved
    doc = {"format": "fastfeed-shard-index", "version": 1,
           "shards": [{"url": url, "size": 10, "crc32": 0, "first": 0, "lengths": [10], "keys": ["k"]}]}  # fmt: skip
    if resolved is None:
        with pytest.raises(ValueError, match=r"test: shards\[0\]\.url .* is outside .*allow_outside_urls=True"):
            ShardIndex.from_json(doc, base, where="test")
        assert len(ShardIndex.from_json(doc, base, where="test", allow_outside_urls=True).urls) == 1
    else:
        assert ShardIndex.from_json(doc, base, where="test").urls == [resolved]


def test_every_index_fastfeed_writes_is_read_and_one_saved_elsewhere_needs_the_opt_in(sets, tmp_path, memfs):
    """index_shards(dest=True), write_shards, an index above its shards and one saved through file:// are read as
    written, their samples exact; one saved apart from its shards names them absolutely, is refused with the way to
    opt in, and is read with allow_outside_urls=True (in ShardIndex.load and in Shards)."""
    src = os.path.join(sets, hostile.ELSEWHERE)
    root = tmp_path / "root"
    shutil.copytree(src, root / "sub")
    shards = sorted(str(p) for p in (root / "sub").glob("*.tar"))
    want = [(i.key(j), i.locate(j)[1:]) for i in [index_shards(shards)] for j in range(i.n_samples)]

    def same(index):
        return [(index.key(j), index.locate(j)[1:]) for j in range(index.n_samples)] == want

    assert same(index_shards(str(root / "sub"), dest=True)) and same(ShardIndex.load(root / "sub"))
    index_shards(shards, dest=root / "above.json")  # shards below the index: "sub/shard-000000.tar"
    assert json.loads((root / "above.json").read_text())["shards"][0]["url"] == "sub/shard-000000.tar"
    assert same(ShardIndex.load(root / "above.json"))
    index_shards(shards, dest=f"file://{root}/sub/via-file-url.json")  # local shards, a file:// index: relative
    assert json.loads((root / "sub" / "via-file-url.json").read_text())["shards"][0]["url"] == "shard-000000.tar"
    assert same(ShardIndex.load(f"file://{root}/sub/via-file-url.json"))
    written = write_shards([{"txt": b"%d" % i} for i in range(5)], str(tmp_path / "w"), progress=False)
    assert ShardIndex.load(tmp_path / "w").n_samples == 5 and len(written) >= 1
    store = f"memory://hostile-{os.getpid()}"
    for p in shards:
        memfs.pipe(f"{store}/{os.path.basename(p)}", open(p, "rb").read())
    index_shards(store, dest=True)
    assert ShardIndex.load(f"{store}/fastfeed-index.json").urls[0] == f"{store}/shard-000000.tar"

    apart = tmp_path / "apart"
    apart.mkdir()
    index_shards(shards, dest=apart / "x.json")  # not beside them: absolute paths
    with pytest.raises(ValueError, match=r"shard index .*x\.json: shards\[0\]\.url .* is outside the index's "
                                         r"directory .*pass allow_outside_urls=True"):  # fmt: skip
        ShardIndex.load(apart / "x.json")
    with pytest.raises(ValueError, match="allow_outside_urls=True"):
        Shards(str(root / "sub"), index=str(apart / "x.json"))
    assert same(ShardIndex.load(apart / "x.json", allow_outside_urls=True))
    ds = Shards(str(root / "sub"), index=str(apart / "x.json"), allow_outside_urls=True)
    ref = {s["__key__"]: s["txt"] for s in Shards(str(root / "sub"))}
    assert {s["__key__"]: s["txt"] for s in ds} == ref and len(ref) == hostile.N


# -- the nesting scan ---------------------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(alphabet='"\\[]{}ab\u00e9\x00 '),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='"\\[]{}x', max_size=4), inner,
                                                               max_size=4),
    max_leaves=25)  # fmt: skip


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(value=_JSON, ascii_only=st.booleans())
def test_the_nesting_scan_counts_what_the_parser_nests_whatever_the_strings_hold(value, ascii_only):
    """Brackets, quotes and backslashes inside strings and keys (escaped or, with ensure_ascii=False, not) never
    move the scan's depth off the value's own; a true or false is seen only outside strings (and Infinity, whose t
    and f tell it from no boolean, only costs the lengths' slower check)."""
    text = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    depth, booleans = index_check.scan(text)
    assert depth == _depth(value)
    assert booleans == bool(re.search(rb"true|false|Infinity", re.sub(rb'"(?:[^"\\]|\\.)*"', b"", text)))


def test_an_index_in_utf16_or_given_as_a_document_reads_the_same(sets):
    """The JSON's own encodings (UTF-16, as json reads them) and from_json's plain documents give the same index as
    the file; nesting past MAX_DEPTH is refused before the parser sees it."""
    path = os.path.join(sets, hostile.SET, hostile.INDEX)
    text = open(path).read()
    base = os.path.dirname(path)
    index = ShardIndex.load(path)
    assert ShardIndex.from_bytes(text.encode("utf-16"), base) == index
    assert ShardIndex.from_json(json.loads(text), base) == index
    deep = '{"format":"fastfeed-shard-index","version":1,"shards":[],"x":' + "[" * 40 + "]" * 40 + "}"
    with pytest.raises(ValueError, match=r"here: not a fastfeed shard index: its JSON nests 41 deep"):
        ShardIndex.from_bytes(deep.encode(), base, where="here")
