"""Running the GPU check: the checks in order, each within its time budget, the tests first, and the exit code."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from .copies import check_async, check_h2d, check_register
from .devices import check_nvml, check_other_device, other_device_child
from .facade import Cuda, gpu_present
from .fake import FakeCuda
from .feeding import check_dali, check_doctor, check_stall
from .races import check_pin_race, check_stage_race
from .report import Check, Report, Skip
from .sizes import DRY, Sizes
from .storage import check_gds

TIME_BUDGET_S = 390.0  # the checks and tests together; the script's build comes before

CHECKS = (
    ("pin_race", "item 1: pin_memory=True, .cuda(non_blocking=True) behind busy kernels", check_pin_race, 60),
    ("stage_race", "the device stage with its copy stream delayed", check_stage_race, 60),
    ("h2d", "H2D copy rates", check_h2d, 60),
    ("async", "non_blocking copies do not block the host", check_async, 30),
    ("register", "registration cost and first-epoch next()", check_register, 60),
    ("other_device", "a loader on cuda:1 leaves GPU 0 alone", check_other_device, 120),
    ("gds", "GPUDirect Storage", check_gds, 90),
    ("nvml", "NVML readings against a known load", check_nvml, 30),
    ("stall", "stall fraction of a ResNet-50-sized step", check_stall, 120),
    ("doctor", "fastfeed.doctor's verdicts", check_doctor, 60),
    ("dali", "DALI's nvJPEG against torch + Pillow", check_dali, 90),
)


class OutOfTime(Exception):
    """A check that ran past its time budget."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise OutOfTime in the main thread after ``seconds``."""

    def alarm(signum, frame):
        raise OutOfTime(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(cuda, z: Sizes, cid: str, title: str, fn, budget: float, left: float) -> Check:
    c = Check(cid, title, cuda.dry_run)
    print(f"{'[dry run] ' if cuda.dry_run else ''}== {cid}: {title}", flush=True)
    t0 = time.perf_counter()
    if left < budget / 3:
        c.status = "FAIL"
        c.line(cid, f"not run: {left:.0f} s of the time budget left, and it needs up to {budget:.0f} s")
        return c
    try:
        with time_limit(min(budget, left)):
            fn(cuda, c, z)
    except Skip as e:
        c.status = "skipped"
        c.line(cid, f"skipped: {e}")
    except Exception as e:  # a check that breaks is a failure with its traceback, and the others still run
        c.status = "error"
        c.line(cid, f"ERROR: {type(e).__name__}: {e}")
        traceback.print_exc()
    if cuda.dry_run and c.status == "ok":
        c.status = "dry-run"  # it ran; only its race checksums were judged, and they held
    # Loaders of this check go now, not inside a later check's forked workers (where their __del__ would run).
    gc.collect()
    c.seconds = round(time.perf_counter() - t0, 1)
    return c


def run_tests(path: str, dry_run: bool, timeout: float) -> dict:
    """tests/test_gpu.py through pytest where it is installed (not in a dry run), else scripts/gpu_tests.py."""
    repo = Path(path).resolve().parents[1]
    have_pytest = not dry_run and importlib.util.find_spec("pytest") is not None
    if have_pytest:
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-rs", "-p", "no:cacheprovider"]
    else:
        cmd = [sys.executable, str(repo / "scripts" / "gpu_tests.py"), path]
    print(f"{'[dry run] ' if dry_run else ''}== tests: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"{e.stdout or ''}\n(stopped after {timeout:.0f} s)", -1
    for line in out.rstrip().splitlines():
        print(f"  | {line}", flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", out.splitlines()[-1]
                                                if out.strip() else "")}  # fmt: skip
    # pytest exits 5 when it collected nothing: with every test skipped that is not a failure.
    ok = rc == 0 or (rc == 5 and not counts.get("failed"))
    return {"runner": "pytest" if have_pytest else "scripts/gpu_tests.py", "exit_code": rc, "ok": ok,
            "counts": counts, "seconds": round(time.perf_counter() - t0, 1), "output_tail": out[-4000:]}


def machine(cuda) -> dict:
    from fastfeed import _pinning

    return {"device": cuda.describe(), "devices": cuda.device_count(), "torch": torch.__version__,
            "cuda_build": torch.version.cuda, "python": platform.python_version(), "cpus": os.cpu_count(),
            "cudart": _pinning.runtime_path() if not cuda.dry_run else os.environ.get("FASTFEED_CUDART")}


def no_cuda() -> int:
    """Exit 2 (no CUDA device) or 3 (a GPU this torch cannot use), saying which."""
    build = f"torch {torch.__version__}, CUDA build: {torch.version.cuda}"
    present = gpu_present()
    if present:
        print(f"gpu_check: a GPU is present ({present}) but torch has no CUDA ({build}): run the check with a "
              "python whose torch is a CUDA build (PYTHON=... bash scripts/gpu_check.sh); nothing measured")
        return 3
    print(f"gpu_check: no CUDA device here ({build}); nothing measured. "
          "`bash scripts/gpu_check.sh --dry-run` runs every check against fakes on the CPU.")  # fmt: skip
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-results"), help="where gpu_check.json goes")
    parser.add_argument("--dry-run", action="store_true", help="every check on the CPU against fakes, tiny sizes")
    parser.add_argument("--tests", help="a test file to run first (scripts/gpu_check.sh: tests/test_gpu.py)")
    parser.add_argument("--only", help="comma-separated check ids (default: all, and the tests): tests, "
                        + ", ".join(c[0] for c in CHECKS))  # fmt: skip
    parser.add_argument("--num-workers", type=int, help="workers of the loaders (default min(8, CPUs))")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--gpu0", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "other_device":
        return other_device_child(FakeCuda() if args.dry_run else Cuda(1), args.gpu0)
    if not args.dry_run and not torch.cuda.is_available():
        return no_cuda()
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {c[0] for c in CHECKS} - {"tests"}
    if unknown:
        parser.error(f"--only: no check named {', '.join(sorted(unknown))}")
    deadline = time.perf_counter() + TIME_BUDGET_S
    cuda = FakeCuda() if args.dry_run else Cuda(0)
    z = DRY if args.dry_run else Sizes()
    z = replace(z, workers=args.num_workers or min(z.workers, os.cpu_count() or 2))
    report = Report(args.out, args.dry_run, list(argv if argv is not None else sys.argv[1:]))
    if args.dry_run:
        print("gpu_check: DRY RUN on the CPU against fakes: no figure below was measured on a GPU, and only the "
              "race checks' checksums are judged", flush=True)  # fmt: skip
    from fastfeed import _pinning

    why_not = _pinning.enable()
    report.data["machine"] = machine(cuda)
    print(f"# {report.data['machine']['device']}; torch {torch.__version__}; {os.cpu_count()} CPUs; "
          f"{z.workers} workers; ring pinning: {why_not or 'ok'}", flush=True)  # fmt: skip
    failed = []
    if why_not and not args.dry_run:
        print(f"gpu_check: FAIL: fastfeed cannot pin its ring on this GPU machine: {why_not}", flush=True)
        failed.append("pinning")
    if args.tests and (only is None or "tests" in only):
        tests = run_tests(args.tests, args.dry_run, timeout=max(30.0, min(240.0, deadline - time.perf_counter())))
        report.data["tests"] = tests
        if not tests["ok"]:
            failed.append("tests")
        report.write()
    for cid, title, fn, budget in CHECKS:
        if only is None or cid in only:
            check = run_check(cuda, z, cid, title, fn, budget, deadline - time.perf_counter())
            report.add(check)
            if check.status in ("FAIL", "error"):
                failed.append(cid)
    code = 1 if failed else 0
    report.data["failed"] = failed
    report.data["exit_code"] = code
    report.write()
    tail = " (DRY RUN: fakes on the CPU; nothing was measured on a GPU)" if args.dry_run else ""
    held = "every check ran" if args.dry_run else "every check held"
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else held}; report "
          f"{report.path}{tail}", flush=True)  # fmt: skip
    return code
