"""The GPU check (scripts/gpu_check.sh, fastfeed/bench/gpu/) on a CPU: its dry run, its exit codes, its
fake CUDA, and that its race checks fail when a copy reads a slot that was rewritten.

The fake's copies read their source by address only when their turn on a fake stream comes, as a DMA does; so
a slot handed back to the workers too early shows as a wrong checksum, here as on a GPU.
"""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastfeed.bench.gpu import races
from fastfeed.bench.gpu.facade import gpu_present
from fastfeed.bench.gpu.fake import FakeCuda
from fastfeed.bench.gpu.main import CHECKS
from fastfeed.bench.gpu.report import REPORT_NAME, Check
from fastfeed.bench.gpu.sizes import DRY

pytestmark = pytest.mark.fastfeed_only

REPO = Path(__file__).resolve().parents[1]

# The figures each check must report in a dry run (a value, not None).
FIGURES = {
    "pin_race": ["bad_batches", "pinned_batches", "distinct_buffers"],
    "stage_race": ["bad_batches", "batches"],
    "h2d": ["ring_gbps", "raw_slot_gbps", "pageable_gbps", "torch_pinned_gbps"],
    "async": ["host_s", "copy_s"],
    "register": ["register_s_per_gb", "unregister_s_per_gb", "epoch1_first_next_s", "epoch1_next_p50_s",
                 "epoch1_next_max_s", "epoch2_next_p50_s", "epoch2_next_max_s"],
    "other_device": ["contexts_on_gpu0", "memory_before", "memory_after", "batches"],
    "gds": ["stall_fraction", "kvikio_compat_mode"],
    "nvml": ["copy_mbps", "nvml_rx_mbps", "nvml_tx_mbps", "nvml_util_busy"],
    "stall": ["step_ms", "fastfeed_stall", "torch_stall"],
    "doctor": ["compute_verdict", "host_sync_verdict", "launch_verdict"],
    "dali": ["dali_images_per_s", "pillow_images_per_s"],
}
# Checks a dry run may skip, and why: DALI where it is not installed.
MAY_SKIP = {"dali"}


def gpu_check(*args, timeout=240):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def test_the_dry_run_runs_every_check_and_reports_every_figure(tmp_path):
    """--dry-run exits 0 on a CPU, says it is a dry run, prints each check, runs test_gpu.py through the fallback
    runner, and writes one JSON report (dry_run: true) with every check's figures."""
    proc = gpu_check("--dry-run", "--out", str(tmp_path / "out"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "DRY RUN" in proc.stdout and "nothing was measured on a GPU" in proc.stdout, out
    assert [c[0] for c in CHECKS] == list(FIGURES)
    for cid in FIGURES:
        assert f"== {cid}:" in proc.stdout, cid
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert report["dry_run"] is True and "DRY RUN" in report["note"] and report["exit_code"] == 0
    assert report["tests"]["runner"] == "scripts/gpu_tests.py" and report["tests"]["ok"], report["tests"]
    assert report["tests"]["counts"].get("skipped", 0) >= 5, report["tests"]
    checks = {c["id"]: c for c in report["checks"]}
    assert list(checks) == list(FIGURES)
    for cid, names in FIGURES.items():
        check = checks[cid]
        if check["status"] == "skipped" and cid in MAY_SKIP:
            continue
        assert check["status"] == "dry-run", (cid, check)  # it ran, and passed nothing on a GPU's behalf
        assert check["lines"], cid
        for name in names:
            assert check["figures"].get(name, {}).get("value") is not None, (cid, name, check["figures"])
    # The fake models the races faithfully: those verdicts were judged, and held.
    for cid in ("pin_race", "stage_race"):
        judged = [v for v in checks[cid]["verdicts"] if v["judged"]]
        assert judged and all(v["ok"] for v in judged), checks[cid]["verdicts"]
    assert all(not v["judged"] for v in checks["h2d"]["verdicts"]), "a dry run must not judge a GPU's figures"


def test_without_a_cuda_device_the_check_exits_2_saying_so(tmp_path):
    """Without --dry-run on a machine without a GPU, the script exits 2 with a line saying there is no CUDA device."""
    if torch.cuda.is_available() or gpu_present():
        pytest.skip("this machine has a GPU")
    proc = gpu_check("--out", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stdout, proc.stdout + proc.stderr


def test_a_gpu_that_torch_cannot_use_exits_3(tmp_path):
    """Where nvidia-smi lists a GPU and torch has no CUDA, the script exits 3 saying so (not 2: a GPU is there)."""
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)'\n")
    smi.chmod(0o755)
    env = dict(os.environ, PYTHON=sys.executable, PATH=f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", str(tmp_path / "out")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "a GPU is present" in out and "torch has no CUDA" in out, out


def test_a_fake_copy_reads_its_source_when_its_stream_gets_to_it():
    """A non_blocking fake copy queued behind a sleep reads its source then; under reads_at_issue() it reads at once."""
    fake = FakeCuda()
    src = torch.ones(4096, dtype=torch.uint8)
    fake.sleep(30)
    late = fake.to_device(src)
    with fake.reads_at_issue():
        early = fake.to_device(src)
    src.fill_(2)
    event = fake.Event()
    event.record()
    assert not event.query()
    fake.synchronize()
    assert event.query()
    assert torch.equal(late, torch.full_like(src, 2)) and torch.equal(early, torch.ones_like(src))


def test_the_pin_memory_check_fails_when_copies_read_their_slots_late():
    """With fake copies that read late (and nothing in fastfeed that can see the fake's streams), slots are rewritten
    before their copies read them, and check_pin_race reports the wrong checksums: FAIL."""
    c = Check("pin_race", "", dry_run=True)
    races.check_pin_race(FakeCuda(), c, DRY, fake_reads_late=True)
    assert c.status == "FAIL" and c.figures["bad_batches"]["value"] > 0, c


def test_the_device_stage_check_fails_when_slots_go_back_before_their_copies(monkeypatch):
    """check_stage_race holds with the device stage as it is, and fails once the stage lets a CPU batch (its slot)
    go before the copy's event completed."""
    from fastfeed import transfer

    z = replace(DRY, copy_sleep_ms=10.0)
    c = Check("stage_race", "", dry_run=True)
    races.check_stage_race(FakeCuda(), c, z)
    assert c.status == "ok" and c.figures["bad_batches"]["value"] == 0, c

    def release_at_once(self):
        self._copying.clear()  # as if every copy had completed

    monkeypatch.setattr(transfer.DeviceIter, "_release_finished", release_at_once)
    c = Check("stage_race", "", dry_run=True)
    races.check_stage_race(FakeCuda(), c, z)
    assert c.status == "FAIL" and c.figures["bad_batches"]["value"] > 0, c


SAMPLE_TESTS = '''
import pytest

pytestmark = [pytest.mark.fastfeed_only]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("kind", ["a", "b"])
def test_params(n, kind):
    assert n in (1, 2) and kind in ("a", "b")


def test_raises():
    with pytest.raises(ValueError, match="bad"):
        raise ValueError("a bad value")


@pytest.mark.skipif(True, reason="never here")
def test_skipped():
    raise AssertionError("ran")


def test_skip_inside():
    pytest.skip("not today")


def test_fails():
    with pytest.raises(KeyError):
        pass


def test_tmp_path(tmp_path):
    (tmp_path / "f").write_text("x")
'''


def test_the_fallback_runner_runs_what_test_gpu_uses(tmp_path):
    """scripts/gpu_tests.py expands parametrize, honours skipif and skip, checks raises, reports failures with their
    traceback and pytest's summary line, and exits 1 when a test failed."""
    path = tmp_path / "test_sample.py"
    path.write_text(textwrap.dedent(SAMPLE_TESTS))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_tests.py"), str(path)], capture_output=True,
                          text=True, timeout=60, check=False, env=dict(os.environ, PYTHONNOUSERSITE="1"))  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    for ident in ("test_params[a-1]", "test_params[b-2]", "test_raises", "test_tmp_path"):
        assert f"PASSED   test_sample.py::{ident} " in out, out
    assert "SKIPPED  test_sample.py::test_skipped (0.0s): never here" in out, out
    assert "SKIPPED  test_sample.py::test_skip_inside" in out and "not today" in out, out
    assert "FAILED   test_sample.py::test_fails" in out and "DID NOT RAISE" in out, out
    assert out.strip().splitlines()[-1].startswith("6 passed, 1 failed, 2 skipped in "), out
