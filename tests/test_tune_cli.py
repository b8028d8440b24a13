"""``fastfeed tune``: targets, what it passes to tune(), its output and config file, and the cache commands."""

import json
import os
import subprocess
import sys

import pytest
import torch

import _tune_targets
import fastfeed
from fastfeed import cli
from fastfeed.tuning import TuneResult, load_config
from fastfeed.tuning.cache import Cache
from fastfeed.tuning.recheck import Recheck

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty tuning cache."""
    monkeypatch.setenv("FASTFEED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeTune:
    """Stands in for fastfeed.tune: records its arguments, reports each trial, returns a fixed result."""

    def __init__(self, result):
        self.result = result
        self.calls = []

    def __call__(self, dataset, *, on_trial=None, **kwargs):
        self.calls.append((dataset, kwargs))
        best = None
        for trial in self.result.trials:
            if not trial.skipped and (best is None or trial.median > best.median):
                best = trial
            on_trial(trial, best)
        return self.result


@pytest.fixture
def fake_tune(monkeypatch):
    fake = FakeTune(_tune_targets.result())
    monkeypatch.setattr(fastfeed, "tune", fake, raising=False)
    return fake


def _epoch(loader):
    return torch.cat([batch.reshape(-1, 2)[:, 0].clone() for batch in loader]).sort().values


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_colon"], "expected module:attr"),
        (["_tune_targets:"], "expected module:attr"),
        (["no_such_module_here:x"], "cannot import no_such_module_here"),
        (["_tune_targets:missing"], "has no attribute 'missing'"),
        (["_tune_targets:not_a_dataset"], "is of type int, not a Dataset, a DataLoader or a callable"),
        (["_tune_targets:returns_number"], "returned an object of type int, not a Dataset or a DataLoader"),
        (["_tune_targets:needs_arguments"], "needs arguments (n)"),
        (["_tune_targets:rows", "--step", "_tune_targets:rows"], "not a function of the batch"),
        (["_tune_targets:rows", "--worker-types", "process,fiber"], "comma-separated list of process, thread"),
        ([], "name what to tune as module:attr"),
        (["_tune_targets:rows", "--show"], "take no target"),
    ],
    ids=["no-colon", "no-attr", "no-module", "attr-missing", "not-dataset", "returns-number", "needs-args",
         "step-not-callable", "worker-type", "no-target", "show-with-target"],  # fmt: skip
)
def test_bad_targets_exit_2(fake_tune, capsys, argv, message):
    """A target that names no usable Dataset or DataLoader ends with status 2 and says why, without tuning."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tune", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert fake_tune.calls == []


def test_dataset_target_and_options(fake_tune):
    """A Dataset target is tuned with the command's options: step, batch size, budget, workers, tolerance."""
    assert cli.main(["tune", "_tune_targets:rows", "--step-ms", "5", "--batch-size", "4", "--budget", "7",
                     "--max-workers", "3", "--tolerance", "0.1", "--worker-types", "process,thread"]) == 0  # fmt: skip
    [(dataset, kwargs)] = fake_tune.calls
    assert dataset is _tune_targets.rows
    assert kwargs == {"step": 0.005, "budget_s": 7.0, "max_workers": 3, "tolerance": 0.1,
                      "worker_types": ("process", "thread"), "batch_size": 4}  # fmt: skip


def test_loader_target_carries_its_arguments(fake_tune):
    """A callable returning a DataLoader makes its arguments the base setting and its worker type the one tried."""
    assert cli.main(["tune", "_tune_targets:make_loader", "--step", "_tune_targets:step"]) == 0
    [(dataset, kwargs)] = fake_tune.calls
    assert dataset is _tune_targets.rows
    assert kwargs["step"] is _tune_targets.step
    assert kwargs["worker_types"] == ("thread",)
    assert {k: kwargs[k] for k in ("batch_size", "shuffle", "drop_last", "collate_fn")} == {
        "batch_size": 8, "shuffle": True, "drop_last": True, "collate_fn": _tune_targets.stack}  # fmt: skip
    assert "sampler" not in kwargs and "pin_memory" not in kwargs


def test_custom_sampler_is_passed_on(fake_tune):
    """A torch DataLoader's own sampler is passed as sampler=, with process workers tried by default."""
    assert cli.main(["tune", "_tune_targets:make_sampled_loader"]) == 0
    [(_, kwargs)] = fake_tune.calls
    assert kwargs["sampler"] is _tune_targets.evens
    assert kwargs["timeout"] == 30 and kwargs["batch_size"] == 4
    assert "shuffle" not in kwargs and "collate_fn" not in kwargs
    assert kwargs["worker_types"] == ("process",)


# capfd, not capsys, where workers are forked: they hand faulthandler the inherited sys.stderr, which
# must be a real file.
def test_writes_config_the_loader_accepts(fake_tune, tmp_path, capfd):
    """--out saves a config that fastfeed.DataLoader takes as is, after printing the table and each trial."""
    out = tmp_path / "config.json"
    assert cli.main(["tune", "_tune_targets:rows", "--batch-size", "8", "--out", str(out)]) == 0
    printed = capfd.readouterr()
    assert str(fake_tune.result) in printed.out
    assert f"saved to {out}" in printed.out
    assert "nw=2 pf=3 process" in printed.err and "skipped: memory budget" in printed.err  # the progress lines
    kwargs = load_config(out)
    assert kwargs == {"num_workers": 2, "prefetch_factor": 3, "worker_type": "process"}
    loader = fastfeed.DataLoader(_tune_targets.rows, batch_size=8, **kwargs)
    assert torch.equal(_epoch(loader), torch.arange(64.0))


def test_result_is_cached_for_auto_loaders(fake_tune, cache_dir, capfd):
    """The CLI's result lands in the cache, where a num_workers="auto", prefetch_factor="auto" loader finds it."""
    assert cli.main(["tune", "_tune_targets:rows", "--batch-size", "8"]) == 0
    assert "cached in" in capfd.readouterr().err
    loader = fastfeed.DataLoader(_tune_targets.rows, batch_size=8, num_workers="auto", prefetch_factor="auto")
    assert isinstance(loader._ff_tuner.search, Recheck)  # used at once, only re-checked on the first epoch
    assert (loader.num_workers, loader.prefetch_factor) == (2, 3)
    assert loader.tune_result == fake_tune.result


def test_json_output(fake_tune, tmp_path, capsys):
    """--json prints only the result's JSON on stdout, even with --out."""
    assert cli.main(["tune", "_tune_targets:rows", "--json", "--out", str(tmp_path / "c.json")]) == 0
    assert TuneResult.from_dict(json.loads(capsys.readouterr().out)) == fake_tune.result


def test_show_and_clear(cache_dir, capsys):
    """--show lists each entry with its dataset, batch size, choice and throughput; --clear removes them all."""
    assert cli.main(["tune", "--show"]) == 0
    assert capsys.readouterr().out.strip() == f"tuning cache {cache_dir / 'tune.json'}: empty"
    cache = Cache()
    cache.put("k1", _tune_targets.result(), {"dataset_type": "_tune_targets.Rows", "batch_size": 8})
    cache.put("k2", _tune_targets.result(num_workers=4, worker_type="thread"),
              {"dataset_type": "_tune_targets.Rows", "batch_size": 32})  # fmt: skip
    assert cli.main(["tune", "--show"]) == 0
    out = capsys.readouterr().out
    assert f"{cache_dir / 'tune.json'}: 2 entries" in out
    [row1] = [line for line in out.splitlines() if line.startswith("k1")]
    [row2] = [line for line in out.splitlines() if line.startswith("k2")]
    assert "_tune_targets.Rows" in row1 and " 8 " in row1
    assert "nw=2 pf=3 process" in row1 and "100.0" in row1
    assert " 32 " in row2 and "nw=4 pf=3 thread" in row2
    assert cli.main(["tune", "--clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 2 entries")
    assert Cache().entries() == {}


def test_python_m_fastfeed_tune(cache_dir):
    """`python -m fastfeed tune --show` runs the same command."""
    env = {**os.environ, "FASTFEED_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-m", "fastfeed", "tune", "--show"], capture_output=True, text=True,
                          cwd=TESTS_DIR, env=env, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(": empty")


def test_end_to_end(tmp_path, capfd):
    """The real tune() on a small dataset chooses a setting whose config fastfeed.DataLoader accepts."""
    out = tmp_path / "config.json"
    assert cli.main(["tune", "_tune_targets:rows", "--batch-size", "8", "--budget", "5", "--max-workers", "2",
                     "--out", str(out)]) == 0  # fmt: skip
    assert "fastfeed tune:" in capfd.readouterr().out
    loader = fastfeed.DataLoader(_tune_targets.rows, batch_size=8, **fastfeed.load_config(out))
    assert torch.equal(_epoch(loader), torch.arange(64.0))
