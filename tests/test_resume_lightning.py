"""Checkpoint/resume of fastfeed's loader through Lightning's Trainer, against the real library.

Lightning saves a loader's ``state_dict()`` in the checkpoint when the loader has ``state_dict()`` and
``load_state_dict()`` (``CombinedLoader._state_dicts``, from ``FitLoop.on_save_checkpoint``) and, on
``fit(ckpt_path=...)``, calls ``load_state_dict()`` on the new loader before its first ``iter()``
(``FitLoop._load_combined_loader_states``). A sized loader is not read ahead by Lightning's data fetcher, so the state
taken at a ``ModelCheckpoint`` is the one after the batches trained on.

Each scenario: an uninterrupted 2-epoch ``Trainer.fit`` that records every sample index it trains on; a run with
``ModelCheckpoint(every_n_train_steps=K)`` that crashes in the training step right after step K (mid-epoch); and a
fresh model and Trainer resumed with ``fit(ckpt_path=<step K>)``. The resumed run must train on the uninterrupted
run's samples from batch K+1 to the end of the second epoch. torchdata's ``StatefulDataLoader`` runs the same
scenario as the reference. A last test runs an unmodified Lightning script that builds torch's DataLoader under
``python -m fastfeed run``.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import _datasets as ds
import fastfeed

L = pytest.importorskip("lightning", reason="lightning is not installed (bash scripts/setup.sh installs it)")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N, BATCH, EPOCHS, K = 20, 3, 2, 3  # 7 batches an epoch (the last of 2); the checkpoint after batch 3 of epoch 0
STEPS = EPOCHS * -(-N // BATCH)

pytestmark = [pytest.mark.hang_limit(120),
              pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")]


class Crash(Exception):
    """The run stopped mid-epoch, as a killed job would."""


class Recorder(L.LightningModule):
    """Trains on ``loader()``'s batches of sample indices and appends each batch to ``seen``; raises ``Crash`` in
    the training step once ``crash_at`` optimizer steps are done (before training on that batch)."""

    def __init__(self, loader, crash_at=None):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.loader, self.crash_at, self.seen = loader, crash_at, []

    def train_dataloader(self):
        return self.loader()

    def training_step(self, batch, batch_idx):
        if self.crash_at is not None and self.global_step == self.crash_at:
            raise Crash(f"stopped after step {self.global_step}")
        self.seen.append(batch.tolist())
        return self.layer(batch.float().view(-1, 1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(root, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=root, **kwargs)  # fmt: skip


def fit(loader, root, crash_at=None, ckpt_path=None, callbacks=()):
    """A fresh model trained by a fresh Trainer; the batches it trained on."""
    L.seed_everything(0, verbose=False)
    model = Recorder(loader, crash_at)
    run = trainer(root, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
    if crash_at is None:
        run.fit(model, ckpt_path=ckpt_path)
    else:
        with pytest.raises(Crash):
            run.fit(model, ckpt_path=ckpt_path)
    return model.seen, run


def loader_factory(kind, num_workers):
    def make():
        args = dict(batch_size=BATCH, shuffle=True, num_workers=num_workers)
        if kind == "torchdata":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(ds.IndexMap(N), **args)
        return fastfeed.DataLoader(ds.IndexMap(N), **args)

    return make


def checkpoint_then_resume(make, tmp_path):
    """(uninterrupted run's batches, the crashed run's, the resumed run's, the resumed Trainer)."""
    full, _ = fit(make, tmp_path / "full")
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=K, save_top_k=-1)
    crashed, _ = fit(make, tmp_path / "crash", crash_at=K, callbacks=[every])
    ckpt = tmp_path / "ckpt" / f"step={K}.ckpt"
    assert ckpt.exists(), sorted(os.listdir(tmp_path / "ckpt"))
    resumed, run = fit(make, tmp_path / "resume", ckpt_path=str(ckpt))
    return full, crashed, resumed, run


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["fastfeed", "torchdata"])
def test_trainer_resumes_a_mid_epoch_checkpoint_at_the_next_batch(tmp_path, kind, num_workers):
    """Trainer.fit(ckpt_path=<a ModelCheckpoint taken after batch K of epoch 0>) trains on the uninterrupted run's
    batches K+1.. of epoch 0 and then all of epoch 1, with fastfeed's loader as with torchdata's."""
    if kind == "torchdata":
        pytest.importorskip("torchdata", reason="torchdata is the reference (bash scripts/setup.sh installs it)")
    full, crashed, resumed, run = checkpoint_then_resume(loader_factory(kind, num_workers), tmp_path)
    assert len(full) == STEPS and sorted(sum(full[: STEPS // 2], [])) == list(range(N))
    assert crashed == full[:K]
    assert resumed == full[K:], (full, resumed)
    assert run.global_step == STEPS
    if kind == "fastfeed":
        assert isinstance(run.train_dataloader, fastfeed.DataLoader)


SCRIPT = '''
"""An unmodified Lightning script: torch's DataLoader. `first`: a whole run, then a run with a checkpoint every
{k} steps that the job ends after step {k}; `resume CKPT`: a new run from that checkpoint. Each writes what it
trained on."""
import json, sys
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset


class Indices(Dataset):
    def __len__(self):
        return {n}

    def __getitem__(self, i):
        return i


class Model(L.LightningModule):
    def __init__(self, crash_at, out):
        super().__init__()
        self.layer, self.crash_at, self.out, self.seen = torch.nn.Linear(1, 1), crash_at, out, []

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size={batch}, shuffle=True, num_workers=2)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise SystemExit(0)  # the job ends here, mid-epoch
        self.seen.append(batch.tolist())
        self.loader = type(self.trainer.train_dataloader)
        with open(self.out, "w") as f:
            json.dump({{"loader": self.loader.__module__ + "." + self.loader.__name__, "seen": self.seen}}, f)
        return self.layer(batch.float().view(-1, 1)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(out, crash_at=None, checkpoints=False, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    every = ModelCheckpoint(dirpath="ckpt", filename="{{step}}", every_n_train_steps={k}, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs={epochs}, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[every] if checkpoints else [],
                        enable_checkpointing=checkpoints)
    trainer.fit(Model(crash_at, out), ckpt_path=ckpt_path)


if sys.argv[1] == "first":
    fit("full.json")
    fit("crash.json", crash_at={k}, checkpoints=True)
else:
    fit("resume.json", ckpt_path=sys.argv[2])
'''


@pytest.mark.fastfeed_only
def test_fastfeed_run_resumes_a_lightning_scripts_torch_loader_at_the_next_batch(tmp_path):
    """`python -m fastfeed run train.py` where train.py builds torch's DataLoader for Lightning: the loader is
    fastfeed's, its state goes into the mid-epoch checkpoint, and a new process resumed from it trains on the
    uninterrupted run's batches from the next one to the end of the next epoch."""
    (tmp_path / "train.py").write_text(SCRIPT.format(n=N, batch=BATCH, k=K, epochs=EPOCHS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # fmt: skip

    def run(*args, loaders):
        proc = subprocess.run([sys.executable, "-m", "fastfeed", "run", "train.py", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=env, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert f"fastfeed run: {loaders} of {loaders} DataLoader(s) replaced" in proc.stderr, proc.stderr[-2000:]

    run("first", loaders=2)  # a whole run, then one that ends after the checkpoint at step K
    run("resume", str(tmp_path / "ckpt" / f"step={K}.ckpt"), loaders=1)  # a new process
    full, crashed, resumed = (json.loads((tmp_path / f"{name}.json").read_text())
                              for name in ("full", "crash", "resume"))  # fmt: skip
    assert full["loader"] == crashed["loader"] == resumed["loader"] == "fastfeed.loader.DataLoader"
    assert len(full["seen"]) == STEPS and crashed["seen"] == full["seen"][:K]
    assert resumed["seen"] == full["seen"][K:], (full["seen"], resumed["seen"])


def test_no_warning_that_the_loader_is_not_resumable(tmp_path):
    """Lightning warns when it resumes mid-epoch with a loader it cannot resume; fastfeed's is one it can."""
    make = loader_factory("fastfeed", 0)
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=K, save_top_k=-1)
    fit(make, tmp_path / "crash", crash_at=K, callbacks=[every])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(make, tmp_path / "resume", ckpt_path=str(tmp_path / "ckpt" / f"step={K}.ckpt"))
    assert not [w for w in caught if "dataloader is not resumable" in str(w.message)]

