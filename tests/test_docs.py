"""The documentation site and the README: the site builds with warnings as errors (a broken link, a stale API name
or a docstring that does not render fails), its benchmark tables are printed from the committed reports, and the
README stays short, opens with the two commands, and links only to files and pages that exist. README and the
install page give the one command that builds the site (``bash scripts/docs.sh``), whose Sphinx call is the one
built here; without fastfeed or torch, the build says what to run. In headless Chromium (skipped where there is
none), no code block scrolls sideways at 1280 px. The integration page's Lightning, Accelerate and DCP scripts run
as printed, stopped mid-epoch and resumed in new processes.

One build per module (about 10-15 s on 2 cores), shared by the tests that read its output.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _chromium import needs_chromium
from _chromium import run as _chromium_run

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
DOCS_SH = REPO / "scripts" / "docs.sh"
DOCS_COMMAND = "bash scripts/docs.sh"


def _sphinx_args() -> list[str]:
    """The arguments scripts/docs.sh gives Sphinx (its one ``.venv/bin/python -m sphinx ...`` line), so the build
    the tests run is the documented one."""
    calls = [line.split() for line in DOCS_SH.read_text().splitlines() if " -m sphinx " in line]
    assert len(calls) == 1 and calls[0][:3] == [".venv/bin/python", "-m", "sphinx"], calls
    return calls[0][3:]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built once, as scripts/docs.sh builds it (``-m sphinx -W --keep-going -b html docs OUT``) with this
    interpreter, quietly and into a temporary folder."""
    missing = [m for m in ("sphinx", "myst_parser", "furo") if not _importable(m)]
    assert not missing, f"the docs build needs {missing}: {DOCS_COMMAND}"
    out = tmp_path_factory.mktemp("site")
    args = _sphinx_args()
    assert args[-2:] == ["docs", "docs/_build/html"], args
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-q", *args[:-1], str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
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


# -- the command that builds the site ------------------------------------------------------------------------------


def test_readme_and_the_install_page_give_the_one_docs_command():
    """README and docs/install.md both tell a reader to run ``bash scripts/docs.sh``, and neither gives another
    Sphinx command than the one that script runs (after the set-up that installs what the build imports)."""
    script = DOCS_SH.read_text()
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    setup, sphinx = lines.index("bash scripts/setup.sh"), next(i for i, x in enumerate(lines) if " -m sphinx " in x)
    assert setup < sphinx, "scripts/docs.sh must set up .venv before it runs Sphinx in it"
    call = lines[sphinx]
    assert os.access(DOCS_SH, os.X_OK)
    install = (DOCS / "install.md").read_text()
    build = install[install.index("## Building this documentation"):]
    assert re.search(r"```bash\n(.*?)```", build, re.S).group(1).strip() == DOCS_COMMAND
    readme = README.read_text()
    assert f"`{DOCS_COMMAND}`" in readme[readme.index("## Documentation"):]
    for name, text in (("README.md", readme), ("docs/install.md", install)):
        others = [m.group(0) for m in re.finditer(r"[\w./-]*(python\S* -m sphinx|sphinx-build)[^`\n]*", text)
                  if m.group(0).strip() != call]  # fmt: skip
        assert not others, f"{name} gives another docs command than scripts/docs.sh: {others}"
        assert "pip install -r docs/requirements.txt" not in text, name  # not enough on its own: fastfeed too


@pytest.mark.parametrize("blocked", ["torch", "fastfeed._C"])
def test_the_build_names_the_command_to_run_when_fastfeed_cannot_be_imported(tmp_path, blocked):
    """Where torch is missing or fastfeed's extension is not built (a fresh clone), Sphinx stops with conf.py's
    message naming ``bash scripts/docs.sh`` and what failed, not with its "programmable error"."""
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"  # importing it now raises ImportError
            "from sphinx.cmd.build import main\n"
            f"sys.exit(main(['-q', '-b', 'html', {str(DOCS)!r}, {str(tmp_path / 'out')!r}]))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert DOCS_COMMAND in proc.stderr and blocked in proc.stderr, proc.stderr[-3000:]
    assert "programmable error" not in proc.stderr, proc.stderr[-3000:]


# -- the site in a browser ---------------------------------------------------------------------------------------

WIDTH = 1280  # a laptop's window

# Loads each page in a 1280-px-wide frame and writes, on <html data-result>, what each page's code blocks do: a
# frame's page lays out as a window of that width would, and one browser start measures every page.
HARNESS = """<!doctype html><html><body style="margin:0"><script>
var pages = %s, out = {}, left = pages.length;
function measure(name, frame) {
  var doc = frame.contentDocument, wide = [];
  doc.querySelectorAll('pre').forEach(function (p) {
    if (p.scrollWidth > p.clientWidth) wide.push(p.scrollWidth + ' > ' + p.clientWidth + ': ' + p.textContent.slice(0, 60));
  });
  out[name] = {pres: doc.querySelectorAll('pre').length, wide: wide, width: doc.documentElement.clientWidth};
  if (--left === 0) document.documentElement.setAttribute('data-result', JSON.stringify(out));
}
pages.forEach(function (name) {
  var f = document.createElement('iframe');
  f.style.width = '%dpx'; f.style.height = '800px';
  f.onload = function () { measure(name, f); };
  f.src = name; document.body.appendChild(f);
});
</script></body></html>"""


def _chromium(url: str, profile: Path, *args: str) -> str:
    """Headless Chromium on ``url`` with ``args``; its stdout (no process of it outlives the call)."""
    return _chromium_run(url, profile, *args)[0]


@needs_chromium
def test_no_code_block_scrolls_sideways_at_1280_px(site, tmp_path):
    """Every guide page, the home page and the install page, 1280 px wide in Chromium: no ``pre`` is wider than
    its box (long lines wrap). The same check on a page without the site's wrap.css does see blocks scroll, and a
    screenshot at 1280 px is a drawn page, not one colour."""
    from PIL import Image

    proc, out, _ = site
    assert proc.returncode == 0
    pages = sorted(p.relative_to(out).as_posix() for p in (out / "guide").glob("*.html"))
    pages += ["index.html", "install.html"]
    page = (out / "guide" / "integrations.html").read_text()
    unwrapped, n = re.subn(r'<link rel="stylesheet"[^>]*_static/wrap\.css[^>]*>', "", page)
    assert n == 1, "conf.py no longer adds _static/wrap.css to the pages"
    (out / "guide" / "unwrapped-check.html").write_text(unwrapped)  # the control: furo's own scrolling blocks
    harness = out / "wrap-check.html"
    harness.write_text(HARNESS % (json.dumps(pages + ["guide/unwrapped-check.html"]), WIDTH))
    dom = _chromium(harness.as_uri(), tmp_path / "profile", "--allow-file-access-from-files",
                    f"--window-size={WIDTH + 40},900", "--dump-dom")  # fmt: skip
    m = re.search(r'data-result="([^"]*)"', dom)
    assert m, "the pages did not all load in the browser"
    result = json.loads(html.unescape(m.group(1)))
    control = result.pop("guide/unwrapped-check.html")
    assert control["wide"], "without wrap.css the integration page's long lines should scroll: the check sees none"
    for name, seen in result.items():
        assert WIDTH - 20 <= seen["width"] <= WIDTH, (name, seen["width"])  # laid out at 1280 px (less a scrollbar)
        assert not seen["wide"], f"{name}: code blocks scroll sideways at {WIDTH} px: {seen['wide']}"
    assert sum(seen["pres"] for seen in result.values()) >= 30, result

    shot = tmp_path / "integrations.png"
    _chromium((out / "guide" / "integrations.html").as_uri(), tmp_path / "profile", f"--window-size={WIDTH},1400",
              f"--screenshot={shot}")  # fmt: skip
    image = Image.open(io.BytesIO(shot.read_bytes())).convert("RGB")
    assert image.size == (WIDTH, 1400)
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 10, colours  # None: more than 65536 colours


# -- the integration page's worked examples ----------------------------------------------------------------------

# heading of the page's section -> (the script's name, the checkpoint its stopped run leaves after step 3)
EXAMPLES = {
    "### Mid-epoch resume, worked through": ("train_lightning.py", "checkpoints/step=3.ckpt"),
    "### Mid-epoch resume with `save_state`, worked through": ("train_accelerate.py", "checkpoints/step-3"),
    "## torch.distributed.checkpoint (DCP)": ("train_dcp.py", "checkpoints/step-3"),
}


def _example(heading: str) -> tuple[str, str]:
    """The first Python block under ``heading`` on the integration page, and the first bash block after it."""
    page = (DOCS / "guide" / "integrations.md").read_text()
    section = page[page.index(heading + "\n"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    commands = re.search(r"```bash\n(.*?)```", section[code.end():], re.S).group(1)
    return code.group(1), commands


@pytest.mark.parametrize("heading", list(EXAMPLES), ids=["lightning", "accelerate", "dcp"])
def test_an_integration_pages_resume_example_resumes_at_the_next_batch(tmp_path, heading):
    """The page's script, as printed, run whole in one folder; then, in another, stopped after step 4 and resumed
    from the step-3 checkpoint in a new process with the page's commands: the resumed run prints the whole run's
    lines from step 4 on (the same samples in the same order, and the same losses, so the model came back too)."""
    name, checkpoint = EXAMPLES[heading]
    pytest.importorskip({"train_lightning.py": "lightning", "train_accelerate.py": "accelerate"}.get(name, "torch"),
                        reason="bash scripts/setup.sh installs it")  # fmt: skip
    code, commands = _example(heading)
    assert commands.split() == ["python", name, "--stop-after", "4", "python", name, "--resume", checkpoint]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # fmt: skip

    def run(folder, *args, rc=0):
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(code)
        proc = subprocess.run([sys.executable, name, *args], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == rc, proc.stdout[-2000:] + proc.stderr[-4000:]
        return [line for line in proc.stdout.splitlines() if line.startswith("step ")]

    whole = run(tmp_path / "whole")
    assert [line.split(":")[0] for line in whole] == [f"step {i}" for i in range(1, 15)], whole
    epoch = [json.loads(line[line.index("["):line.index("]") + 1]) for line in whole[:7]]
    assert sorted(sum(epoch, [])) == list(range(20)), whole  # one epoch is every sample once
    stopped = run(tmp_path / "job", "--stop-after", "4", rc=1)
    assert stopped == whole[:4]
    resumed = run(tmp_path / "job", "--resume", checkpoint)
    assert resumed == whole[3:], (whole, resumed)
