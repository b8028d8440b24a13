"""`fastfeed run`: a script's torch DataLoaders, however it names them, become fastfeed's with the same batches."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.utils.data as tud

from fastfeed import DataLoader as FastLoader
from fastfeed import replace

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.fastfeed_only

MYLIB = '''
import torch.utils.data as tud
Loader = tud.DataLoader          # a module-level alias

class LibLoader(tud.DataLoader):  # a library's subclass
    def __init__(self, dataset, **kw):
        self.tag = "lib"
        super().__init__(dataset, **kw)

class Custom(tud.DataLoader):     # replaces torch's iterator factory: not safe to move onto fastfeed's
    def _get_iterator(self):
        return super()._get_iterator()
'''

TRAIN = '''
import torch
from torch.utils.data import DataLoader, TensorDataset
import mylib
ds = TensorDataset(torch.arange(40.).view(20, 2))
loaders = [DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), num_workers=2),
           mylib.Loader(ds, batch_size=3, num_workers=1),
           mylib.LibLoader(ds, batch_size=5, num_workers=2),
           mylib.Custom(ds, batch_size=5)]
for dl in loaders:
    fast = any(c.__module__.startswith("fastfeed") for c in type(dl).__mro__)
    print(type(dl).__name__, fast, [b[0].tolist() for b in dl], getattr(dl, "tag", None))
'''


def run(tmp_path, *args, fastfeed=True, **env):
    (tmp_path / "mylib.py").write_text(MYLIB)
    (tmp_path / "train.py").write_text(TRAIN)
    cmd = [sys.executable, "-m", "fastfeed", "run", *args] if fastfeed else [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), **env))  # fmt: skip
    return proc


def test_three_ways_of_building_torch_loaders_are_replaced_with_the_same_batches(tmp_path):
    """A direct import, a module-level alias and a library subclass become fastfeed's; batches equal plain python's."""
    plain = run(tmp_path, "train.py", fastfeed=False)
    ours = run(tmp_path, "train.py")
    assert plain.returncode == ours.returncode == 0, ours.stderr
    lines = [line.split(" ", 2) for line in ours.stdout.splitlines()]
    assert [(name, fast) for name, fast, _ in lines] == [("DataLoader", "True"), ("DataLoader", "True"),
                                                         ("LibLoader", "True"), ("Custom", "False")]  # fmt: skip
    assert [rest for _, _, rest in lines] == [line.split(" ", 2)[2] for line in plain.stdout.splitlines()]
    summary = ours.stderr.strip().splitlines()[-1]
    assert summary.startswith("fastfeed run: 3 of 4 DataLoader(s) replaced by fastfeed's (made at train.py:6, "
                              "train.py:7, train.py:8)")  # fmt: skip
    assert "mylib.Custom at train.py:9 (it overrides _get_iterator" in summary


def test_excluded_classes_stay_torchs(tmp_path):
    """FASTFEED_RUN_EXCLUDE=mylib.LibLoader leaves that class alone and says so."""
    proc = run(tmp_path, "train.py", FASTFEED_RUN_EXCLUDE="mylib.LibLoader")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2].startswith("LibLoader False")
    assert "mylib.LibLoader at train.py:8 (excluded by FASTFEED_RUN_EXCLUDE)" in proc.stderr


SPAWNED = '''
import multiprocessing as mp
def child(q):
    import torch.utils.data as tud
    dl = tud.DataLoader(list(range(6)), batch_size=2)
    q.put((type(dl).__module__, [b.tolist() for b in dl]))
if __name__ == "__main__":
    ctx = mp.get_context("{method}")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=60))
    p.join()
'''


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_processes_started_anew_replace_their_loaders_too(tmp_path, method):
    """A spawned or forkserver child builds fastfeed's loader (through FASTFEED_RUN and a sitecustomize)."""
    (tmp_path / "spawned.py").write_text(SPAWNED.format(method=method))
    proc = run(tmp_path, "spawned.py")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "('fastfeed.loader', [[0, 1], [2, 3], [4, 5]])"


def test_modules_exit_codes_and_missing_scripts(tmp_path):
    """-m runs a module as python -m does; the script's exit code is fastfeed run's; a missing script is named."""
    (tmp_path / "job.py").write_text("import sys, torch.utils.data as t\nt.DataLoader([1])\nsys.exit(3)\n")
    proc = run(tmp_path, "-m", "job")
    assert proc.returncode == 3 and "1 of 1 DataLoader(s) replaced" in proc.stderr
    proc = run(tmp_path, "nope.py")
    assert proc.returncode == 2 and "no script at 'nope.py'" in proc.stderr


def test_the_patch_is_undone_and_fastfeeds_own_loaders_are_untouched():
    """Replacer.close() restores torch's __init__; a fastfeed.DataLoader built meanwhile is not counted."""
    before = tud.DataLoader.__init__
    replacer = replace.Replacer().install()
    try:
        assert type(tud.DataLoader([1, 2])) is FastLoader
        FastLoader([1, 2])
    finally:
        replacer.close()
    assert tud.DataLoader.__init__ is before and type(tud.DataLoader([1])) is tud.DataLoader
    assert [m.replaced for m in replacer.made] == [True]
