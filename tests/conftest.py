"""Shared test machinery: leak checks after every test, a hang guard, candidate selection.

Set FASTFEED_TEST_AGAINST_TORCH=1 to run the suite with torch's own DataLoader as the
candidate (see _candidate.py); tests marked `fastfeed_only` are then skipped.
"""

import faulthandler
import math
import multiprocessing.resource_tracker
import os
import pickle
import signal
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Spawned workers unpickle datasets by module name; they inherit sys.path, so putting
# tests/ on it here lets `_datasets` import there however pytest was started.
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# Ray reads this once, when it is imported: set before any test imports it, every node of a test cluster listens
# and connects on 127.0.0.1 (by default Ray takes the machine's outward address even on one machine).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import _candidate  # noqa: E402
import _leaks  # noqa: E402
from _load import load_stretch  # noqa: E402

DEFAULT_HANG_LIMIT_S = 60
LEAK_GRACE_S = 5.0  # on an idle machine; stretched as the hang limit is


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: in a module the quick tier leaves out (SLOW_MODULES); -m 'not slow'")
    config.addinivalue_line("markers", "fastfeed_only: checks a fastfeed extension torch lacks")
    config.addinivalue_line("markers", "hang_limit(seconds): fail the test if it runs longer")
    config.addinivalue_line("markers", "ray_sockets: Ray's own connections may stay open past the test")
    # A suite started in the background of a non-interactive shell (`bash scripts/test.sh &`, as a CI runner or a
    # script may) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler: not in this
    # process (an xdist worker's, too), nor in the scripts the tests start, which inherit the ignored signal. The
    # tests of Ctrl-C would wait forever for an interrupt nothing hears. Install the handler a terminal's Python has;
    # the scripts started from here then begin with the default disposition, as from a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config):
    return f"DataLoader under test: {_candidate.NAME}"


# The quick tier (`bash scripts/test.sh --quick`, which is -m "not slow") leaves these modules out: each spends most
# of its time starting things (torchrun jobs, Ray clusters, spawned workers, benchmark and doctor runs, Sphinx,
# Chromium), about four fifths of the full suite's time. The full suite, the README's command and CI, runs them.
SLOW_MODULES = frozenset({
    "test_accelerate", "test_base_install", "test_bench_cli", "test_bench_ray", "test_bench_shards", "test_benchmarks",
    "test_dali", "test_dcp", "test_docs", "test_doctor", "test_doctor_html", "test_doctor_job", "test_doctor_launch",
    "test_doctor_memory", "test_doctor_ray_cluster", "test_faults", "test_gpu_check", "test_lifecycle",
    "test_no_targets", "test_parity", "test_pinning", "test_properties", "test_ray", "test_ray_pool_gaps",
    "test_remote_storm", "test_resume_accelerate", "test_resume_cases", "test_resume_lightning",
    "test_resume_out_of_order", "test_run", "test_sanitizers", "test_share", "test_shards",
    "test_shards_index_hostile", "test_shards_order", "test_state_fuzz", "test_torchdata_states", "test_tune",
    "test_tune_memory", "test_tune_noise", "test_tune_ranks", "test_tune_recheck",
})  # fmt: skip


def pytest_collection_modifyitems(config, items):
    missing = sorted(m for m in SLOW_MODULES if not os.path.exists(os.path.join(TESTS_DIR, m + ".py")))
    if missing:  # a renamed module would otherwise join the quick tier unnoticed
        raise pytest.UsageError(f"tests/conftest.py SLOW_MODULES names no such test module: {', '.join(missing)}")
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if not _candidate.AGAINST_TORCH:
        return
    skip = pytest.mark.skip(reason="fastfeed extension; FASTFEED_TEST_AGAINST_TORCH is set")
    for item in items:
        if "fastfeed_only" in item.keywords:
            item.add_marker(skip)


def assert_spawn_picklable(*objs):
    """Fail unless each object survives pickling by reference, as spawn requires.

    Spawn re-imports the defining module in the worker, so classes and functions must be
    module-level in an importable module (tests/_datasets.py), never in a test body.
    """
    for obj in objs:
        owner = obj if callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        assert "<locals>" not in owner.__qualname__, f"{owner.__qualname__} is not module-level"
        assert owner.__module__ != "__main__", f"{owner.__qualname__} lives in __main__"
        pickle.loads(pickle.dumps(obj))


@pytest.fixture(scope="session", autouse=True)
def _session_singletons():
    """Start once-per-process helpers before the first test so they don't read as leaks.

    The first spawn starts multiprocessing's resource tracker, a child process that
    lives until the interpreter exits.
    """
    multiprocessing.resource_tracker.ensure_running()
    yield


@pytest.fixture(scope="session")
def fonts_open(tmp_path_factory):
    """matplotlib keeps the fonts it drew with open, a cache for the process's life: open them before the
    per-test leak check takes its first snapshot, so they do not read as leaked descriptors."""
    from fastfeed.doctor import plot
    from fastfeed.doctor.timeline import Timeline

    plot.timeline_png(Timeline(start=0.0, end=1.0), tmp_path_factory.mktemp("fonts") / "warm.png", title="warm up")


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves behind a child process, a file descriptor or a shm segment."""
    before = _leaks.Snapshot.take()
    yield
    # pytest keeps a failed test's traceback in sys.last_* (for post-mortem debugging);
    # its frames would keep that test's loaders alive and report the failure twice.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    # Ray's driver keeps a gRPC channel to each actor process it has called (its client pool), closed on Ray's own
    # schedule: tests marked ray_sockets check every other descriptor, and actors and references themselves.
    sockets = request.node.get_closest_marker("ray_sockets") is None
    # Processes exit and unlink their segments later on a busy machine: the wait ends as soon as nothing is left.
    grace = LEAK_GRACE_S * load_stretch()
    leaked = _leaks.wait_for_no_leaks(before, timeout=grace, sockets=sockets)
    if leaked:
        pytest.fail(
            f"{request.node.nodeid} leaked (still there {grace:.0f} s after it ended):\n  "
            + "\n  ".join(leaked),
            pytrace=False,
        )


# The backstop's stack dump, in a file: while a test runs, pytest has its stderr captured, and a process that
# faulthandler ends takes the captured text with it. scripts/test.sh prints the file when the run fails.
# Under pytest-xdist each worker process keeps its own file (.pytest-hang-gw0.txt ...): one shared file would be
# truncated by one worker's next test while another's stacks are being written.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
HANG_DUMP = os.environ.get("FASTFEED_HANG_DUMP") or os.path.join(
    os.path.dirname(os.path.dirname(__file__)), f".pytest-hang-{_WORKER}.txt" if _WORKER else ".pytest-hang.txt")
_hang_file = open(HANG_DUMP, "w")  # noqa: SIM115 - open for the whole session: faulthandler writes to its fd


def pytest_unconfigure(config):
    _hang_file.close()  # the session is over: no test runs for faulthandler to dump


def _arm_dump(nodeid: str, seconds: float) -> None:
    """In ``seconds``, dump every thread's stack into the hang file and exit (the backstop), unless cancelled."""
    _hang_file.seek(0)
    _hang_file.truncate()
    _hang_file.write(f"{nodeid} still running after {seconds:.0f} s; every thread's stack:\n")
    _hang_file.flush()
    faulthandler.dump_traceback_later(seconds, exit=True, file=_hang_file)


class HangGuardTimeout(Exception):
    """The test ran past its hang limit."""


@pytest.fixture(autouse=True)
def hang_guard(request, no_leaks):
    """Turn a hang into a failure: SIGALRM raises in the test; faulthandler is the backstop.

    Depends on no_leaks so that the alarm is disarmed before the leak check polls.
    """
    marker = request.node.get_closest_marker("hang_limit")
    base = int(marker.args[0]) if marker else DEFAULT_HANG_LIMIT_S
    # A guard against hangs, not a timing assertion: on a machine whose runnable processes outnumber its cores
    # (other work beside the suite, or its own xdist workers), every test runs that many times slower, so the limit
    # stretches by the same factor, up to 4x.
    def stretched():
        return int(base * load_stretch())

    limit = stretched()
    started = time.monotonic()

    def on_alarm(signum, frame):
        # The load average lags the load by a minute: load that rose after the test began (a Ray cluster's actors
        # starting, other work beside the suite) stretches the limit too, still up to 4x, looked at when it is reached.
        nonlocal limit
        waited = time.monotonic() - started
        later = stretched()
        if later > limit and waited < later:
            limit = later
            signal.alarm(math.ceil(later - waited))
            _arm_dump(request.node.nodeid, later - waited + 30)
            return
        raise HangGuardTimeout(f"test still running after {limit} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    # If the alarm can't interrupt (stuck in native code holding the GIL), dump every
    # thread's stack and exit rather than hang the whole suite.
    _arm_dump(request.node.nodeid, limit + 30)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _hang_file.seek(0)
        _hang_file.truncate()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def spawn_picklable():
    """assert_spawn_picklable, for tests that start workers with spawn."""
    return assert_spawn_picklable
