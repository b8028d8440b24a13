"""The doctor's HTML report (``fastfeed doctor --html``, ``report.save(dir, html=True)``): one self-contained page.

Its content is checked without a browser, on recorded timelines (``_timelines``): nothing it loads comes from
outside the file, the verdict comes first, then the timeline, the six questions, the advice (predicted against
measured) and the what-ifs, user data is escaped, and a job gets a lane per rank. Then the demo's page and a job's
are rendered in headless Chromium (skipped where there is none): no script error, the verdict visible, the
timeline drawn, a screenshot that is not blank.
"""

from __future__ import annotations

import html
import io
import json
import re
import subprocess
import sys
import time
from html.parser import HTMLParser

import pytest

import fastfeed
from fastfeed import doctor
from fastfeed.doctor import html as doctor_html
from fastfeed.doctor.jobreport import JobReport
from fastfeed.doctor.ranks import RankRecord
from fastfeed.doctor.report import Report

import _chromium as chromium
from _chromium import needs_chromium
from _timelines import make

pytestmark = pytest.mark.fastfeed_only

HOSTILE = '<script>alert("made_at")</script>&"x.py'
HOSTILE_ARG = "\"><img src=x onerror=alert(1)>/data/</script>"
STALL = doctor_html.STALL


class _Page(HTMLParser):
    """The page's elements in order (tag, attrs) and the text of each element with an id, and of each section."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.body: list[tuple[str, dict]] = []  # the body's elements in order
        self.text: dict[str, str] = {}
        self._open: list[tuple[str, str | None]] = []
        self._in_body = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "body":
            self._in_body = True
        elif self._in_body:
            self.body.append((tag, attrs))
        if tag not in ("meta", "br", "img", "input", "link"):
            self._open.append((tag, attrs.get("id")))
            if attrs.get("id"):
                self.text.setdefault(attrs["id"], "")

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _tag, ident in self._open:
            if ident:
                self.text[ident] += data


def _data(page: str) -> dict:
    """The timeline's data the page embeds."""
    m = re.search(r'<script type="application/json" id="ff-data">(.*?)</script>', page, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1))


def _timeline(**kwargs):
    kw = dict(worker_s=0.03, samples={"cpu_busy": 0.5, "iowait": 0.01, "gpu_util": 0.4}, gpu=True, epochs=2)
    kw.update(kwargs)
    return make([0.02] * 30, [0.01] * 30, **kw)


def _report(timeline=None, closing: bool = True) -> Report:
    """A single process's report with every what-if, the closing one measuring the first advice with a setting."""
    report = Report(timeline=timeline or _timeline(), command=["fastfeed", "doctor", "train.py", "--data", "/d"])
    report.whatif = {"input_ceiling": {"samples_per_s": 700.0, "batches_per_s": 43.75, "batches": 60, "seconds": 1.4},
                     "compute_ceiling": {"samples_per_s": 1600.0, "batches_per_s": 100.0, "batches": 60,
                                         "seconds": 0.6},
                     "skipped": {}}  # fmt: skip
    advice = [a for a in report.verdict().advice if a["setting"]]
    assert advice, "the recorded loop should have advice with a setting"
    if closing:
        best = advice[0]
        report.whatif["closing"] = {"change": best["change"], "setting": best["setting"], "samples_per_s": 1234.5,
                                    "batches_per_s": 77.2, "predicted_samples_per_s": best["predicted_samples_per_s"],
                                    "predicted_gain": best["predicted_gain"], "gain": 2.17,
                                    "gain_with_startup": 1.9}  # fmt: skip
    return report


def _rank(rank: int, wait: float, sync: float, gpu: bool = True) -> RankRecord:
    """A rank of a job in step with the others: it waits ``wait`` per batch and sleeps ``sync`` in each step."""
    tl = make([wait] * 12, [0.05 + sync] * 12, worker_s=0.005, epochs=2, gpu=gpu,
              samples={"cpu_busy": 0.25 + 0.01 * rank, **({"gpu_util": 0.5} if gpu else {})})  # fmt: skip
    for ep in tl.loaders[0].epochs:
        ep.blocked = [wait + i * (wait + sync) for i in range(len(ep.asks))]
    return RankRecord(rank=rank, timeline=tl, host=f"node{rank // 2}", local_rank=rank % 2)


def _job_report(world: int = 4) -> JobReport:
    """Rank 1 waits for its input; the others wait for it in the step's sync."""
    return JobReport([_rank(r, 0.16 if r == 1 else 0.01, 0.0 if r == 1 else 0.15) for r in range(world)],
                     command=["fastfeed", "doctor", "--nproc-per-node", str(world), "train.py"])  # fmt: skip


def assert_self_contained(page: str) -> None:
    """Nothing on the page is fetched: no URL in a src or href, no <link>, no external script, no CSS import or
    url() but the page's own fragments, and a Content-Security-Policy that forbids every request."""
    assert not re.search(r"""\b(?:src|href|action|data|poster)\s*=\s*["']?\s*(?:https?:|//|ftp:|file:)""", page, re.I)
    assert not re.search(r"https?://", page.replace("http://www.w3.org/2000/svg", ""), re.I)  # SVG's namespace only
    assert not re.search(r"<link\b", page, re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", page, re.I)
    assert not re.search(r"<(?:img|iframe|object|embed|audio|video|source)\b", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(?!#)", page, re.I)
    assert "default-src 'none'" in page


def test_a_page_is_self_contained_verdict_first_then_timeline_questions_advice_whatifs():
    report = _report()
    d = report.to_dict()
    page = report.html(d)
    assert_self_contained(page)
    parsed = _Page(page)
    first = parsed.body[0]
    assert first[0] == "p" and first[1].get("id") == "verdict", parsed.body[:3]
    assert parsed.text["verdict"] == d["verdict"]["line"]
    sections = [a["id"] for tag, a in parsed.body if tag == "section"]
    assert sections == ["timeline", "questions", "advice", "whatif", "text"], sections
    questions = parsed.text["questions"]
    assert len(d["questions"]) == 6
    for q in d["questions"]:
        assert q["question"] in questions and q["how"] in questions, q
    advice = parsed.text["advice"]
    for a in d["advice"]:
        assert a["change"] in advice and a["why"] in advice, a
    closing = d["whatif"]["closing"]
    assert "1234.5 samples/s (2.17x)" in advice  # measured, beside the advice it measured
    assert f"{closing['predicted_samples_per_s']:.1f} samples/s ({closing['predicted_gain']:.2f}x)" in advice
    whatifs = parsed.text["whatif"]
    for title in ("measured run", "compute ceiling (cached batch)", "input ceiling (loader, no step)",
                  "with " + closing["change"]):  # fmt: skip
        assert title in whatifs, title
    assert "1600.0" in whatifs and "700.0" in whatifs and "measured 2.17x" in whatifs
    assert parsed.text["text"].strip().endswith(report.summary(d).splitlines()[-1])
    # the timeline: the loop's stalls and steps, the workers, the GPU and the CPU
    data = _data(page)
    loop, workers, gpu, cpu = data["tracks"]
    parts = {p["name"]: p for p in loop["lanes"][0]["parts"]}
    assert len(parts["input wait (stall)"]["spans"]) == 60 and len(parts["step"]["spans"]) == 58
    assert [lane["label"] for lane in workers["lanes"]] == ["worker 0", "worker 1"]
    assert [s["name"] for s in gpu["series"]] == ["GPU busy"]
    assert [s["name"] for s in cpu["series"]] == ["CPU busy", "iowait"]
    assert len(data["marks"]) == 1  # the second epoch's start


def test_a_page_without_whatifs_or_gpu_says_so():
    report = Report(timeline=make([0.02] * 10, [0.01] * 10, samples={"cpu_busy": 0.3}), command=["x"])
    page = report.html()
    parsed = _Page(page)
    assert "No what-if run" in parsed.text["whatif"]
    gpu = _data(page)["tracks"][1]
    assert gpu["series"] == [] and "NVML unavailable" in gpu["title"]


def test_user_data_is_escaped_in_the_markup_and_the_embedded_data():
    tl = _timeline()
    tl.loaders[0].made_at = HOSTILE
    report = _report(tl)
    report.command = ["fastfeed", "doctor", "train.py", HOSTILE_ARG]
    page = report.html()
    for raw in (HOSTILE, HOSTILE_ARG, "<script>alert", "<img src=x", "</script>&"):
        assert raw not in page, raw
    assert page.count("</script>") == 3  # the page's own: the error catcher, the data, the drawing
    parsed = _Page(page)
    assert HOSTILE in parsed.text["text"] and HOSTILE_ARG in parsed.text["about"]  # shown as text
    assert not any(tag in ("img", "iframe") for tag, _ in parsed.elements)
    scripts = [a for tag, a in parsed.elements if tag == "script"]
    assert len(scripts) == 3 and not any("src" in a for a in scripts)
    data = _data(page)  # the JSON holds the name as it is, for the script to set as text
    assert HOSTILE in data["tracks"][0]["title"] and HOSTILE in data["tracks"][0]["lanes"][0]["full"]
    assert_self_contained(page)


def test_a_jobs_page_has_the_jobs_verdict_first_and_a_lane_per_rank():
    report = _job_report(4)
    d = report.to_dict()
    page = report.html(d)
    assert_self_contained(page)
    parsed = _Page(page)
    assert parsed.body[0][1].get("id") == "verdict"
    assert parsed.text["verdict"] == d["job"]["verdict"]["line"] and "rank 1 holds the job back" in d["job"][
        "verdict"]["line"]  # fmt: skip
    data = _data(page)
    lanes = data["tracks"][0]["lanes"]
    assert [lane["key"] for lane in lanes] == ["rank-0", "rank-1", "rank-2", "rank-3"]
    assert [lane["strong"] for lane in lanes] == [False, True, False, False]  # the straggler stands out
    for lane in lanes:
        assert {p["name"] for p in lane["parts"]} >= {"input wait (stall)", "compute"}, lane["label"]
    assert {p["name"] for p in lanes[0]["parts"]} == {"input wait (stall)", "compute", "sync"}
    assert [s["name"] for s in data["tracks"][1]["series"]] == [f"rank {r}" for r in range(4)]
    ranks = parsed.text["ranks"]
    assert all(f"node{r // 2}" in ranks for r in range(4)) and "straggler" in ranks
    assert "The six questions (rank 1's loop, the rank the verdict is about)" in parsed.text["questions"]
    for a in d["job"]["advice"]:
        assert a["change"] in parsed.text["advice"]
    assert "not run" in parsed.text["whatif"]  # a job's ceilings are skipped, and say why


def test_a_long_run_shows_shares_over_time_bins(monkeypatch):
    monkeypatch.setattr(doctor_html, "MAX_SPANS", 20)
    monkeypatch.setattr(doctor_html, "BINS", 50)
    data = doctor_html.timeline_data(_timeline())
    parts = {p["name"]: p for p in data["tracks"][0]["lanes"][0]["parts"]}
    bins = parts["input wait (stall)"]["bins"]
    assert len(bins["share"]) == 50 and all(0 <= s <= 1 for s in bins["share"])
    # waits of 20 ms and steps of 10 ms: 2/3 of the loop's time (less the pause between epochs) waiting
    total = sum(s * bins["dt"] for s in bins["share"])
    assert total == pytest.approx(60 * 0.02, rel=0.02)
    assert "spans" not in parts["step"] and len(parts["step"]["bins"]["share"]) == 50


def test_watch_reports_save_html(tmp_path):
    loader = fastfeed.DataLoader(list(range(64)), batch_size=8, num_workers=0)
    with doctor.watch() as report:
        for _batch in loader:
            time.sleep(0.002)
    paths = report.save(tmp_path, plot=False, trace=False, html=True)
    page = paths["html"].read_text()
    assert paths["html"].name == "report.html" and oct(paths["html"].stat().st_mode & 0o777) == "0o644"
    assert _Page(page).text["verdict"] == report.verdict().line
    assert "html" not in report.save(tmp_path / "plain", plot=False, trace=False)  # opt-in


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory):
    """``fastfeed doctor --html`` on the demo, without --out, in a directory of its own: once for the test of what
    it writes there and the test that renders the page (the page is the same one --out writes: ``write_page`` of
    the report's ``html()``). Returns the finished process and the directory."""
    where = tmp_path_factory.mktemp("demo-page")
    cmd = [sys.executable, "-m", "fastfeed", "doctor", "--steps", "30", "--no-whatif", "--html", "--demo"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=where), where


def test_the_cli_writes_report_html_in_the_current_directory_without_out(demo_page):
    proc, where = demo_page
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in where.iterdir()) == ["report.html"]
    page = (where / "report.html").read_text()
    assert _Page(page).text["verdict"] == proc.stdout.splitlines()[0]
    assert "html: report.html" in proc.stderr


# -- in a real browser ---------------------------------------------------------------------------------------------

def render(path, tmp_path, height: int = 2000) -> tuple[str, str, bytes]:
    """The page at ``path`` in headless Chromium: its DOM once loaded and its script run, the browser's log, and a
    1280-wide screenshot. The browser runs in a session of its own, killed whole on a timeout; no process of it may
    outlive the call."""
    shot = tmp_path / "screenshot.png"
    dom, log = chromium.run(path.resolve().as_uri(), tmp_path / "profile", "--enable-logging=stderr", "--v=0",
                            f"--window-size=1280,{height}", "--dump-dom", f"--screenshot={shot}")  # fmt: skip
    return dom, log, shot.read_bytes() if shot.exists() else b""


def assert_rendered(dom: str, log: str, png: bytes, verdict: str, lanes: list[str]) -> None:
    """No console message (a script error, a refused request), no error caught by the page, the verdict visible,
    the timeline drawn with its lanes, and a screenshot of more than one colour."""
    from PIL import Image

    console = [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    root = re.search(r"<html\b[^>]*>", dom).group(0)
    assert "data-errors" not in root, root
    assert 'data-verdict-visible="yes"' in root, root
    m = re.search(r'<p id="verdict"[^>]*>(.*?)</p>', dom, re.S)
    assert m and html.unescape(m.group(1)) == verdict, m and m.group(0)
    assert f'data-rendered="{len(lanes)}"' in root, root
    for lane in lanes:
        assert f'data-lane="{lane}"' in dom, lane
    assert len(re.findall(rf'<rect [^>]*fill="{STALL}"', dom)) >= 10  # the stalls, drawn
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size == (1280, image.size[1]) and image.size[1] > 500
    colours = image.getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 10, colours  # None: more than 65536 colours


@needs_chromium
def test_the_demos_page_renders_in_a_browser(demo_page, tmp_path):
    proc, where = demo_page
    assert proc.returncode == 0, proc.stderr
    verdict = proc.stdout.splitlines()[0]
    page = (where / "report.html").read_text()
    assert_self_contained(page)
    dom, log, png = render(where / "report.html", tmp_path)
    assert_rendered(dom, log, png, verdict, ["loader-0", "worker 0"])
    assert "The six questions" in dom and "What-if runs" in dom


@needs_chromium
def test_a_page_with_every_whatif_renders_in_a_browser(tmp_path):
    report = _report()
    path = report.save(tmp_path / "out", plot=False, trace=False, html=True)["html"]
    dom, log, png = render(path, tmp_path)
    assert_rendered(dom, log, png, report.verdict().line, ["loader-0", "worker 0", "worker 1"])
    assert "1234.5 samples/s (2.17x)" in dom


@needs_chromium
def test_a_jobs_page_renders_a_lane_per_rank_in_a_browser(tmp_path):
    report = _job_report(4)
    path = report.save(tmp_path / "job", plot=False, trace=False, html=True)["html"]
    dom, log, png = render(path, tmp_path, height=1400)
    assert_rendered(dom, log, png, report.job.line, [f"rank-{r}" for r in range(4)])


@needs_chromium
def test_the_browser_check_sees_a_script_error(tmp_path):
    """The checks above would catch a broken page: the same page with its script broken fails them."""
    path = tmp_path / "broken.html"
    path.write_text(_job_report(2).html().replace("JSON.parse(", "JSON.parsee("))
    dom, log, _png = render(path, tmp_path, height=600)
    assert "Uncaught TypeError" in log
    assert re.search(r'<html\b[^>]*data-errors="1"', dom)


# Events a user would make on the timeline, each followed by what the page then shows (on <html data-*>).
INTERACT = """<script>
(function(){var c=document.getElementById('ff-chart'),r=c.getBoundingClientRect(),root=document.documentElement;
function note(k){root.setAttribute('data-'+k,document.getElementById('ff-range').textContent+' | '+
  c.querySelectorAll('.ff-lane rect').length);}
function at(x){return {clientX:r.left+x,clientY:r.top+40,bubbles:true,cancelable:true};}
note('start');
for(var i=0;i<8;i++){c.dispatchEvent(new WheelEvent('wheel',Object.assign({deltaY:-100},at(500))));}
note('zoomed');
c.dispatchEvent(new MouseEvent('mousedown',at(700)));window.dispatchEvent(new MouseEvent('mousemove',at(400)));
window.dispatchEvent(new MouseEvent('mouseup',at(400)));note('panned');
c.dispatchEvent(new MouseEvent('dblclick',at(500)));note('reset');
document.querySelector('button[data-zoom="in"]').click();note('button');})();
</script></body>"""


def _shown(dom: str, key: str) -> tuple[float, float, int]:
    """What the page showed after ``key``: the range in view (seconds) and the rectangles drawn in the lanes."""
    text = re.search(rf'data-{key}="showing ([\d.]+) to ([\d.]+) s of [\d.]+ s \| (\d+)"', dom)
    assert text, (key, re.search(r"<html\b[^>]*>", dom).group(0))
    return float(text.group(1)), float(text.group(2)), int(text.group(3))


@needs_chromium
def test_the_timeline_zooms_pans_and_resets_in_a_browser(tmp_path):
    """The wheel zooms in around the pointer (fewer spells drawn), a drag to the left shows later times, a
    double-click shows the whole run again, and the zoom button halves the range."""
    path = tmp_path / "report.html"
    path.write_text(_report().html().replace("</body>", INTERACT))
    dom, log, _png = render(path, tmp_path, height=900)
    assert not [line for line in log.splitlines() if ":CONSOLE" in line], log[-2000:]
    assert "data-errors" not in re.search(r"<html\b[^>]*>", dom).group(0)
    a0, b0, n0 = _shown(dom, "start")
    a1, b1, n1 = _shown(dom, "zoomed")
    a2, b2, _n2 = _shown(dom, "panned")
    assert (a0, b0, _shown(dom, "reset")[:2]) == (0.0, pytest.approx(2.8, abs=0.01), (a0, b0))
    assert 0 < a1 and b1 < b0 and (b1 - a1) < 0.3 * (b0 - a0) and n1 < n0 / 2, (a1, b1, n1, n0)
    assert a2 > a1 and b2 - a2 == pytest.approx(b1 - a1, abs=0.02), (a1, b1, a2, b2)
    a4, b4, _ = _shown(dom, "button")
    assert b4 - a4 == pytest.approx((b0 - a0) / 2, abs=0.02)
