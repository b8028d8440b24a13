"""From evidence to a verdict: which stage makes the loop wait, how badly, why, and what to change.

Severity follows TensorBoard's input-pipeline analyzer: "highly" input-bound at ≥ 20% of the loop's time spent
waiting for input, "moderately" at ≥ 5%. Below that the loop is not input-bound, and the GPU's utilisation and the
main thread's CPU tell compute, host syncs and launch overhead apart. Every piece of advice is computed from
measured rates (the workers' per-batch time, the loop's step time, the what-if ceilings), never from the settings.
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field

from ..stats import quantile
from . import memory
from .evidence import Evidence, cv, gather, ms, pearson
from .ranks import RankSplit
from .timeline import Timeline

HIGHLY, MODERATELY = 0.20, 0.05
FREE_CORES_MIN = 0.5  # less than half a core idle: another CPU-bound worker has nowhere to run
BLOCKED = 0.5  # workers using under half the CPU time they are busy for are waiting on something: reads
IOWAIT, PSI_IO, READ_MS = 0.10, 0.10, 20.0
GPU_BUSY = 0.6
MAIN_BUSY = 0.7
# What to start for advice that needs Ray actors on other machines, when no cluster is reachable from here.
START_RAY = ("`ray start --head` on one CPU node and `ray start --address=<head>:6379` on each other, then set "
             "RAY_ADDRESS=<head>:6379 here (or start the head on this machine) and run again")


@dataclass
class Verdict:
    """The doctor's answer. ``bottleneck``: input, compute, host_sync, launch or (a job's rank) sync; ``cause``:
    for input cpu, io, workers, transfer or numa, for sync ``stragglers`` (waiting for slower ranks to have their
    batch) or ``collectives`` (the collectives' own time); ``severity``: highly, moderately or not (input-bound),
    or of the sync for a sync-bound rank."""

    bottleneck: str
    cause: str | None
    severity: str
    line: str
    evidence: dict
    questions: list = field(default_factory=list)
    advice: list = field(default_factory=list)
    periodic: dict | None = None
    dips: dict | None = None
    memory: dict | None = None  # fastfeed.doctor.memory.analyse: the workers' growth, headroom, copy-on-read

    def as_dict(self) -> dict:
        return asdict(self)


def _severity(stall: float) -> str:
    return "highly" if stall >= HIGHLY else "moderately" if stall >= MODERATELY else "not"


def _blocked(ev: Evidence) -> bool:
    """Workers (or the loop, loading in-process) busy for far longer than they used a CPU: waiting on reads."""
    if ev.loader is None:
        return False
    if ev.loader.num_workers == 0:
        main = ev.system.get("main_cpu")
        return main is not None and ev.wait_s > 0 and main * ev.span_s / ev.wait_s < BLOCKED
    if ev.worker_cpu is None:
        return False
    busy = statistics.fmean(ev.worker_busy) if ev.worker_busy else 1.0  # torch's workers: busy while input-bound
    return busy > 0 and ev.worker_cpu / busy < BLOCKED


def _cause(ev: Evidence, placement: dict | None) -> str:
    if placement and placement.get("off_node"):
        return "numa"
    wait_p50 = quantile(ev.waits, 0.5)
    if ev.h2d_p50_s is not None and wait_p50 and ev.h2d_p50_s >= 0.5 * wait_p50:
        return "transfer"
    sysf = ev.system
    free = ev.free_cores
    starved = free is not None and free < FREE_CORES_MIN
    # Workers using less CPU than they are busy for wait on something: reads, or, with no core free, a core (more
    # CPU-bound workers than cores, or other processes on them): then they are not blocked in reads.
    if ((sysf.get("iowait") or 0) >= IOWAIT or (sysf.get("psi_io") or 0) >= PSI_IO
            or (sysf.get("disk_read_ms") or 0) >= READ_MS or (_blocked(ev) and not starved)):  # fmt: skip
        return "io"
    if starved and ev.steady_stall_fraction >= MODERATELY:
        return "cpu"
    return "workers"


def _not_input(ev: Evidence) -> str:
    util = ev.system.get("gpu_util")
    if not ev.gpu or util is None or util >= GPU_BUSY:
        return "compute"
    return "launch" if (ev.system.get("main_cpu") or 0) >= MAIN_BUSY else "host_sync"


def stall_events(ev: Evidence, starts: bool = False) -> list[int]:
    """Batches whose wait was a stall: over 1 ms and over a quarter of the median step (and, unless ``starts``,
    not an epoch's first batch)."""
    step = quantile(ev.steps, 0.5) or 0.0
    floor = max(1e-3, 0.25 * step)
    return [i for i, (w, steady) in enumerate(zip(ev.waits, ev.steady)) if (steady or starts) and w > floor]


def periodic(ev: Evidence, events: list[int]) -> dict | None:
    """Stalls that come every ``period`` batches, as when ``num_workers`` workers finish together."""
    gaps = [b - a for a, b in zip(events, events[1:]) if all(ev.steady[a + 1:b + 1])]  # within one epoch
    if len(gaps) < 4:
        return None
    period, count = Counter(gaps).most_common(1)[0]
    share = count / len(gaps)
    if period < 2 or share < 0.6:
        return None
    nw = ev.loader.num_workers if ev.loader else 0
    return {"period": period, "share": share, "stalls": len(events), "num_workers": nw,
            "bursts": nw > 1 and period % nw == 0}  # fmt: skip


def dips(tl: Timeline, ev: Evidence, events: list[int]) -> dict | None:
    """Samples where GPU utilisation fell below half its 90th percentile, each tied to the stalls it overlaps."""
    util = [(s["t"] - s.get("dt", 0.1), s["t"], s["gpu_util"]) for s in tl.samples if s.get("gpu_util") is not None]
    top = quantile([u for _, _, u in util], 0.9)
    if not util or not top or top < 0.2:
        return None
    stalls = [ev.ends[i] for i in events]
    found, examples = 0, []
    low = [(a, b, u) for a, b, u in util if u < 0.5 * top]
    for a, b, u in low:
        hit = [(s, e) for s, e in stalls if s < b and e > a]
        if hit:
            found += 1
            if len(examples) < 5:
                examples.append({"t": a - tl.start, "gpu_util": u, "stall_ms": 1e3 * max(e - s for s, e in hit)})
    return {"dips": len(low), "explained": found, "examples": examples}


def _ceiling(ev: Evidence, whatif: dict) -> tuple[float, bool]:
    """The compute ceiling (batches/s): measured with synthetic input, else the loop with its waits taken out
    (and, on a job's rank, its waits for the other ranks)."""
    run = whatif.get("compute_ceiling")
    if run and run.get("batches_per_s"):
        return run["batches_per_s"], True
    return (ev.batches / ev.compute_s if ev.compute_s > 0 else math.inf), False


def _per_worker_s(ev: Evidence, whatif: dict) -> float | None:
    """Seconds one worker takes per batch: its own records, else the input ceiling shared out, else the waits."""
    nw = ev.loader.num_workers if ev.loader else 0
    if ev.worker_batch_s:
        return ev.worker_batch_s
    run = whatif.get("input_ceiling")
    if run and run.get("batches_per_s"):
        return max(nw, 1) / run["batches_per_s"]
    if nw == 0:
        return quantile(ev.waits, 0.5)
    return nw / ev.batches_per_s if ev.batches_per_s > 0 else None


def questions(tl: Timeline, ev: Evidence, whatif: dict, events: list[int]) -> list[dict]:
    """The six questions to ask of a stalling loop, each answered with a number."""
    iteration = [w + s for w, s in zip(ev.waits, ev.steps)]
    out = []
    util = [(s["t"], s["gpu_util"]) for s in tl.samples if s.get("gpu_util") is not None]
    if util and ev.ends:
        per = []
        for t, u in util:
            inside = [w + s for (a, r), w, s in zip(ev.ends, ev.waits, ev.steps) if t - 0.1 < r <= t]
            per.append((statistics.fmean(inside) if inside else None, u))
        r = pearson([p for p, _ in per], [u for _, u in per])
        out.append(("Does step time move with the utilisation swings?", r, "r",
                    "correlation of iteration time with GPU utilisation per sample"))
    else:
        r = pearson(iteration, ev.waits[:len(iteration)])
        out.append(("Does step time move with the utilisation swings?", r, "r",
                    "no GPU utilisation here: correlation of iteration time with the input wait"))
    ceiling, measured = _ceiling(ev, whatif)
    gain = ceiling / ev.batches_per_s if ev.batches_per_s > 0 and math.isfinite(ceiling) else None
    out.append(("Do the idle gaps shrink with synthetic input?", gain, "x",
                ("measured" if measured else "estimated from the step times") + ": rate with free input / rate now"))
    out.append(("Are there host-side stalls before kernel launches?", ev.stall_fraction, "share",
                f"share of the loop spent waiting for a batch (p95 wait {ms(quantile(ev.waits, 0.95))})"))
    if ev.fetch:
        out.append(("Is storage access uneven from step to step?", cv(ev.fetch), "cv",
                    "coefficient of variation of the workers' per-batch fetch time"))
    else:
        out.append(("Is storage access uneven from step to step?", cv(ev.waits), "cv",
                    "coefficient of variation of the input wait (the loader reports no fetch times)"))
    if ev.sync_s is not None:
        out.append(("Does distributed sync dominate?", ev.sync_fraction, "share",
                    "share of the loop waiting for the other ranks (DDP's all-reduce inside backward(), collectives, "
                    "barriers), measured on the ranks' aligned step timelines"))
    else:
        share = ev.distributed_s / ev.loop_s if ev.loop_s > 0 else 0.0
        how = "share of the loop in torch.distributed collectives called from Python"
        if ev.world > 1:  # one rank of a job, watched alone
            how += (f"; one of {ev.world} ranks watched alone, so DDP's all-reduce inside backward() and the waits "
                    "for other ranks are not in it: fastfeed doctor --nproc-per-node N measures them")
        else:
            how += " (0: not distributed; for a job's ranks run fastfeed doctor --nproc-per-node N)"
        out.append(("Does distributed sync dominate?", share, "share", how))
    out.append(("Is there too little work per step?", (quantile(ev.steps, 0.5) or 0.0) * 1e3, "ms",
                "median step time" + (f", GPU busy {ev.system['gpu_util']:.0%}" if ev.system.get("gpu_util")
                                      is not None else "")))  # fmt: skip
    return [{"question": q, "value": v, "unit": u, "how": how} for q, v, u, how in out]


DALI_NAMES = {"num_workers": "num_threads", "prefetch_factor": "prefetch_queue_depth"}  # a DALI loader's knobs


def advise(ev: Evidence, bottleneck: str, cause: str | None, whatif: dict, per: dict | None) -> list[dict]:
    """Settings to change, each with its predicted effect, from measured rates."""
    advice = []
    loader = ev.loader
    if loader is None or ev.batches_per_s <= 0:
        return advice
    now = ev.batches_per_s
    ceiling, _ = _ceiling(ev, whatif)
    bs = ev.batch_size

    def item(change, setting, why, predicted, needs=None):
        advice.append({"change": change, "setting": setting, "why": why,
                       "predicted_samples_per_s": None if predicted is None else predicted * bs,
                       "predicted_gain": None if predicted is None else predicted / now,
                       "needs": needs})  # fmt: skip

    nw = loader.num_workers

    names = DALI_NAMES if loader.kind == "dali" else {}

    def knob(name: str) -> str:
        return names.get(name, name)

    t = _per_worker_s(ev, whatif)
    if bottleneck == "input" and cause in ("workers", "io") and ev.steady_stall_fraction >= MODERATELY and t:
        want = math.ceil(min(ceiling, 1e6) * t * 1.1)  # workers to make batches as fast as the step takes them
        if want > nw:
            cap = ev.cpus if cause == "workers" else 4 * ev.cpus  # blocked workers need no core of their own
            k = min(want, max(cap, nw + 1))
            predicted = min(ceiling, k / t, now * k / max(nw, 1)) if nw else min(ceiling, k / t)
            why = (f"each worker makes a batch in {ms(t)}, so {k} make {k / t:.1f}/s; the step alone runs "
                   f"{ceiling:.1f} batches/s")
            if cause == "io":
                why += "; the workers spend most of that waiting (reads), not computing, so more of them overlap it"
            item(f"{knob('num_workers')}={k}", {"num_workers": k}, why, predicted)
    if bottleneck == "input" and cause == "io" and not loader.prefetch:
        item("read ahead: give the dataset prefetch(indices) (fastfeed.io.Files has it)", None,
             "the workers wait on reads one at a time; with read-ahead each keeps many in flight while it decodes",
             None)
    if bottleneck == "input" and cause == "cpu":
        item("make each sample cheaper (decode or transform less on the CPU, or on the GPU)", None,
             f"the CPUs are {ev.system.get('cpu_busy', 0):.0%} busy: more workers have no core to run on", None)
        remote = _remote_workers(loader, t, ceiling)
        if remote is not None:
            item(*remote)
    if bottleneck == "input" and ev.epochs > 1 and not loader.persistent_workers and loader.num_workers:
        startup = ev.first_wait_s / ev.epochs
        if ev.first_wait_s >= 0.05 * ev.loop_s:
            saved = ev.loop_s - (ev.epochs - 1) * startup
            item("persistent_workers=True", {"persistent_workers": True},
                 f"each epoch waits {ms(startup)} for its first batch while new workers start",
                 ev.batches / saved if saved > 0 else None)
    if per and per.get("bursts") and bottleneck == "input" and (loader.prefetch_factor or 2) < 4:
        item(f"{knob('prefetch_factor')}=4", {"prefetch_factor": 4},
             f"stalls come every {per['period']} batches, when the {nw} workers finish together", None)
    fastfeed = whatif.get("input_ceiling_fastfeed")
    torch_in = whatif.get("input_ceiling")
    if loader.kind == "torch" and fastfeed and torch_in and bottleneck == "input":
        ratio = fastfeed["batches_per_s"] / torch_in["batches_per_s"] if torch_in["batches_per_s"] else None
        if ratio and ratio >= 1.1:
            item("from fastfeed import DataLoader", {"fastfeed": True},
                 f"with the same arguments fastfeed's loader delivers {ratio:.2f}x torch's batches/s (measured)",
                 min(ceiling, now * ratio))
    if bottleneck == "host_sync":
        item("remove per-step host syncs (.item(), .cpu(), printing tensors); read metrics every N steps", None,
             f"the GPU is busy {ev.system.get('gpu_util', 0):.0%} and the host waits with no input wait", None)
    if bottleneck == "launch":
        item("more work per step: a larger batch, torch.compile or CUDA graphs", None,
             f"the host is busy {ev.system.get('main_cpu', 0):.0%} launching while the GPU idles", None)
    if bottleneck == "input" and cause == "transfer":
        item("pin_memory=True, or device='cuda' (fastfeed's copy stage overlaps the copy)", None,
             f"host-to-device copies take {ms(ev.h2d_p50_s)} of a {ms(quantile(ev.waits, 0.5))} wait", None)
    if bottleneck == "input" and cause == "numa":
        item("numa='auto' (fastfeed places workers and memory on the GPU's node)", None,
             "workers or their memory are on another NUMA node than the GPU", None)
    # What this machine can do comes first, and the closing run measures the first of it with a setting; advice
    # that needs another machine (Ray actors with no cluster reachable) follows, in its own order (stable sort).
    advice.sort(key=lambda a: a["needs"] is not None)
    return advice


def ray_installed() -> bool:
    """Whether Ray can be imported here (never importing it: that takes seconds)."""
    return importlib.util.find_spec("ray") is not None


def ray_cluster_reachable() -> bool:
    """Whether ``worker_type="ray"`` would find a cluster from here: this process connected already (the script's
    own ``ray.init``), ``RAY_ADDRESS`` set, or a Ray head (``ray start --head``) running on this machine. Never
    imports Ray nor connects: that takes seconds, and a cluster that does not answer fails the closing run in one
    line anyway."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return True
    if os.environ.get("RAY_ADDRESS"):
        return True
    from ..info import _ray_started

    return _ray_started()


def _remote_workers(loader, t: float | None, ceiling: float) -> tuple | None:
    """For input/cpu: the workers the step rate calls for, the local ones kept and the shortfall as Ray actors.

    Returns ``item``'s arguments (change, setting, why, predicted batches/s, needs), or None when the workers the
    step needs are there already (or nothing says how many it needs). Advised whether or not a cluster is
    reachable now: without one, ``needs`` says what to start (the advice then ranks after what runs here, and no
    closing run tries it); without Ray installed the setting is left out too, and the why says so.
    """
    if loader.kind == "dali" or not t or not math.isfinite(ceiling):
        return None
    want = math.ceil(ceiling * t * 1.1)  # workers to make batches as fast as the step takes them, with 10% spare
    local = loader.local_workers
    r = want - local
    if r <= loader.remote_workers:
        return None
    if local:
        change = f'worker_type=("process", "ray"), num_workers=({local}, {r})'
        setting = {"worker_type": ("process", "ray"), "num_workers": (local, r)}
    else:
        change = f'worker_type="ray", num_workers={r}'
        setting = {"worker_type": "ray", "num_workers": r}
    predicted = min(ceiling, (local + r) / t)
    why = (f"each worker makes a batch in {ms(t)} and the step alone runs {ceiling:.1f} batches/s, so it takes "
           f"{want} workers (+10%) to keep up; the {local} local ones stay, and the {r} more run as Ray actors on "
           f"other machines' CPUs: {local + r} make {(local + r) / t:.1f} batches/s")
    if loader.kind == "torch":
        why += " (fastfeed's DataLoader takes this setting)"
        setting["fastfeed"] = True
    needs = None
    if not ray_installed():
        why += "; Ray workers need pip install 'fastfeed[ray]' and a Ray cluster (ray start --head)"
        setting = None
        needs = f"pip install 'fastfeed[ray]' and a Ray cluster on the CPU nodes ({START_RAY})"
    elif not ray_cluster_reachable():
        # The setting stays (it is what to apply once the cluster runs), but no run here can measure it.
        needs = f"a Ray cluster, and none is reachable from here: {START_RAY}"
    return change, setting, why, predicted, needs


def _line(bottleneck: str, cause: str | None, severity: str, ev: Evidence) -> str:
    stall = f"{ev.stall_fraction:.0%} of the loop waiting for input"
    if bottleneck == "sync":
        return (f"verdict: {severity} sync-bound ({bottleneck}/{cause}): {ev.sync_fraction:.0%} of the loop waiting "
                f"for the other ranks, {stall}")
    if bottleneck == "input":
        return f"verdict: {severity} input-bound ({bottleneck}/{cause}): {stall}"
    return f"verdict: {bottleneck}-bound, not input-bound: {stall}"


def diagnose(tl: Timeline, whatif: dict | None = None, sync: RankSplit | None = None) -> Verdict:
    """The verdict on a timeline, using what-if results when there are any.

    ``sync``: for one rank of a job, its loop split against the other ranks' (``ranks.split``): a rank that
    spends more of its loop waiting for the others than for input or computing, and at least ``HIGHLY``, is
    sync-bound.
    """
    whatif = whatif or {}
    ev = gather(tl)
    if sync is not None:
        ev.sync_s = sync.sync_s
    severity = _severity(ev.stall_fraction)
    compute = 1.0 - ev.stall_fraction - ev.sync_fraction
    if sync is not None and ev.sync_fraction >= max(HIGHLY, ev.stall_fraction, compute):
        bottleneck, severity = "sync", _severity(ev.sync_fraction)
        cause = "stragglers" if sync.waiting_for_others_s >= 0.5 * sync.sync_s else "collectives"
    elif severity != "not":
        bottleneck, cause = "input", _cause(ev, tl.placement)
    else:
        bottleneck, cause = _not_input(ev), None
    events = stall_events(ev)
    per = periodic(ev, events)
    advice = advise(ev, bottleneck, cause, whatif, per)
    mem = memory.analyse(tl, ev)
    share = memory.advice(mem)
    if share is not None:  # whatever holds the loop back: copying the dataset into every worker costs memory
        advice.append(share)  # needs a change to the script: after what runs here (see advise)
    return Verdict(bottleneck=bottleneck, cause=cause, severity=severity, line=_line(bottleneck, cause, severity, ev),
                   evidence=ev.summary(), questions=questions(tl, ev, whatif, events), advice=advice, periodic=per,
                   dips=dips(tl, ev, stall_events(ev, starts=True)), memory=mem)  # fmt: skip
