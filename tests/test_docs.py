"""The documentation site and the README: the site builds with warnings as errors (a broken link, a stale API name
or a docstring that does not render fails), its benchmark tables are printed from the committed reports, and the
README stays short, opens with the two commands, and links only to files and pages that exist.

One build per module (about 10-15 s on 2 cores), shared by the tests that read its output.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"
pytestmark = pytest.mark.fastfeed_only

OPENING = [
    "```bash",
    "bash scripts/demo.sh    # set-up, fastfeed against torch's DataLoader on synthetic data (the ratios, fastfeed run),"
    " then the doctor",
    "bash scripts/test.sh    # set-up, then the whole test suite (CPU only; GPU tests skip)",
    "```",
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once: ``python -m sphinx -W --keep-going -b html docs OUT`` with this interpreter."""
    missing = [m for m in ("sphinx", "myst_parser", "furo") if not _importable(m)]
    assert not missing, f"the docs build needs {missing}: pip install -r docs/requirements.txt"
    out = tmp_path_factory.mktemp("site")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)  # fmt: skip
    return proc, out, time.monotonic() - start


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_site_builds_without_a_warning(site):
    """Every page, cross-reference, heading anchor and autodoc'd name resolves (-W turns each warning into a
    failure; --keep-going lists them all)."""
    proc, out, seconds = site
    assert proc.returncode == 0, f"sphinx-build failed after {seconds:.1f} s:\n{proc.stderr[-6000:]}"
    api = (out / "api" / "index.html").read_text()
    for name in ("fastfeed.DataLoader", "fastfeed.tune", "fastfeed.doctor.watch", "fastfeed.io.Shards",
                 "fastfeed.Stats", "fastfeed.io.write_shards", "fastfeed.dali.DALILoader"):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"
    for page in ("index", "install", "troubleshooting", "guide/loader", "guide/shards", "guide/ray",
                 "guide/doctor", "guide/tuning", "benchmarks/standard", "gpu-check"):
        assert (out / f"{page}.html").is_file(), page


def test_the_benchmark_tables_are_printed_from_the_reports_at_build_time(site, tmp_path):
    """The build replaces each block's body with what the report gives, whatever the page holds; the built pages
    carry the reports' figures."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import bench_tables
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    from fastfeed.bench import report

    class App:
        srcdir = str(DOCS)

        class env:
            note_dependency = staticmethod(lambda path: None)

    stale = "<!-- fastfeed bench --from docs/bench/standard.json --markdown overhead -->\n| stale |\n<!-- end -->"
    source = [f"# page\n\n{stale}\n\ntext after\n"]
    bench_tables._fill(App, "page", source)
    expected = report.markdown(report.load(DOCS / "bench" / "standard.json"), ["overhead"])
    assert f"-->\n{expected}\n<!-- end -->" in source[0] and "stale" not in source[0] and "text after" in source[0]

    proc, out, _ = site
    assert proc.returncode == 0
    built = (out / "benchmarks" / "standard.html").read_text()
    for cell in re.findall(r"\*\*(\d+\.\d\dx)\*\*", expected):
        assert cell in built


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the details belong in docs/"
    assert lines[:4] == OPENING
    made = [line for line in lines if re.search(r"\b(issues?|sessions?|we (built|made|wrote|added))\b", line, re.I)]
    assert not made, made[:3]  # the README speaks of fastfeed, not of how it was made


def test_every_relative_link_of_the_readme_resolves(site):
    """Each relative link (and image) names a file of the repository; one into docs/ names a page the site built,
    and its #anchor, if any, a heading of that page."""
    proc, out, _ = site
    assert proc.returncode == 0
    links = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:", t)]
    assert any(t.startswith("docs/") and t.endswith(".md") for t in links), "the README links into the docs"
    for target in links:
        path, _, anchor = target.partition("#")
        assert path, f"{target}: an anchor alone (the README has few headings to link to)"
        assert (REPO / path).exists(), f"README.md links to {target}, which is not in the repository"
        if path.startswith("docs/") and path.endswith(".md"):
            page = out / (path[len("docs/"):-len(".md")] + ".html")
            assert page.is_file(), f"README.md links to {target}, which is not a page of the site"
            if anchor:
                assert f'id="{anchor}"' in page.read_text(), f"{target}: no such heading"
