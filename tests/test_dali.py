"""fastfeed.dali: DALI pipelines with DataLoader manners, run for real (CPU-only pipelines need no GPU)."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

dali = pytest.importorskip("nvidia.dali", reason="fastfeed[dali] is not installed")

import _dali  # noqa: E402
from nvidia.dali import fn, pipeline_def, types  # noqa: E402

import fastfeed.dali as ffdali  # noqa: E402
from fastfeed.dali import DALILoader, folders  # noqa: E402

pytestmark = pytest.mark.fastfeed_only
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return _dali.make_folder(tmp_path_factory.mktemp("jpegs"))


@pipeline_def
def plain(files, labels, shuffle=False, shard_id=0, num_shards=1, pad_last_batch=True):
    jpegs, label = fn.readers.file(files=files, labels=labels, random_shuffle=shuffle, shard_id=shard_id,
                                   num_shards=num_shards, pad_last_batch=pad_last_batch, name="Reader")  # fmt: skip
    images = fn.decoders.image(jpegs, device="cpu")
    return images, fn.cast(fn.reshape(label, shape=[]), dtype=types.INT64)


def loader(jpegs, batch_size=4, **kw):
    paths, labels = _dali.files_and_labels(jpegs)
    kw.setdefault("num_threads", 1)
    return DALILoader(plain, kw.pop("output_map", ("images", "labels")), batch_size=batch_size, files=paths,
                      labels=labels, **kw)  # fmt: skip


def epoch(dl):
    return [_dali.ids(b) for b in dl]


ALL = sorted(10 * c + i for c in range(3) for i in range(7))


@pytest.mark.parametrize("last_batch,batch_size", [("partial", 4), ("drop", 4), ("pad", 4), ("partial", 7),
                                                   ("drop", 5), ("pad", 8), ("partial", 32), ("drop", 32)])
def test_len_is_exact_in_every_epoch(jpegs, last_batch, batch_size):
    """len() equals the batches yielded, epoch after epoch, for each last-batch rule; the samples are torch's."""
    dl = loader(jpegs, batch_size, last_batch=last_batch)
    full, rest = divmod(21, batch_size)
    expected = {"partial": full + bool(rest), "drop": full, "pad": full + bool(rest)}[last_batch]
    for _ in range(3):
        batches = epoch(dl)
        assert len(batches) == len(dl) == expected
        flat = [x for b in batches for x in b]
        if last_batch == "partial":
            assert flat == ALL
        elif last_batch == "drop":
            assert flat == ALL[: full * batch_size] and all(len(b) == batch_size for b in batches)
        else:
            assert flat[:21] == ALL and set(flat[21:]) <= {ALL[-1]} and all(len(b) == batch_size for b in batches)


def test_batches_are_dicts_or_tuples_of_torch_tensors(jpegs):
    """A list output_map gives dicts, a tuple gives tuples; labels are int64 like ImageFolder's after collation."""
    batch = next(iter(loader(jpegs, output_map=["images", "labels"])))
    assert set(batch) == {"images", "labels"}
    assert batch["images"].shape == (4, 24, 32, 3) and batch["images"].dtype == torch.uint8
    assert batch["labels"].dtype == torch.int64 and batch["labels"].tolist() == [0, 0, 0, 0]
    images, labels = next(iter(loader(jpegs, output_map=("images", "labels"))))
    assert isinstance(images, torch.Tensor) and labels.shape == (4,)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_has_the_same_len_and_the_ranks_cover_the_data(jpegs, world, monkeypatch):
    """With torchrun's RANK / WORLD_SIZE, each rank reads its shard; lens agree; the shards cover every sample."""
    seen, lens = [], set()
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        for last_batch in ("partial", "drop"):
            dl = loader(jpegs, 3, last_batch=last_batch)
            for _ in range(2):  # DALI's readers move to the next shard each epoch: sizes stay equal
                batches = epoch(dl)
                assert len(batches) == len(dl)
                lens.add((last_batch, len(dl)))
            if last_batch == "partial":
                seen += [x for b in epoch(dl) for x in b]
            dl.close()
    assert len(lens) == 2  # one len per rule, the same on every rank
    assert set(seen) == set(ALL)


def test_an_epoch_restarted_midway_reads_the_rest_first_with_a_warning(jpegs):
    """break, then iterate again: the rest of the epoch is read and discarded (warned), and the new epoch is whole."""
    dl = loader(jpegs)
    for _ in dl:
        break
    with pytest.warns(RuntimeWarning, match="5 batches before the end of epoch 0"):
        it = iter(dl)
    assert [x for b in it for x in _dali.ids(b)] == ALL


def test_an_older_iterator_is_refused_after_a_new_one(jpegs):
    """Two live iterators cannot share DALI's pipeline: the older one raises a clear error."""
    dl = loader(jpegs)
    old = iter(dl)
    next(old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        new = iter(dl)
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(old)
    assert len(list(new)) == len(dl)


RESUME_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_dali as t
dl = t.loader({root!r}, 4, output_map=("images", "labels"), shuffle=True, seed=7, last_batch={last_batch!r})
mode, path = sys.argv[1], sys.argv[2]
out = []
if mode == "save":
    for epoch in range({epochs}):
        for i, batch in enumerate(dl):
            out.append(t._dali.ids(batch))
            if epoch == {epochs} - 1 and i + 1 == {k}:
                torch.save(dl.state_dict(), path)
                break
    print("IDS", out)
else:
    dl.load_state_dict(torch.load(path, weights_only=True))
    for epoch in range(2):
        out.append([t._dali.ids(b) for b in dl])
    print("IDS", out)
"""


@pytest.mark.parametrize("last_batch,epochs,k", [("partial", 1, 2), ("partial", 2, 5), ("drop", 1, 5)])
def test_resume_in_a_new_process_yields_the_next_batches_exactly(jpegs, tmp_path, last_batch, epochs, k):
    """state_dict() after batch k (of epoch e); a new process with load_state_dict yields k+1.. then the next epoch,
    exactly as an uninterrupted run does (shuffled, seeded)."""
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(RESUME_SCRIPT.format(tests=TESTS_DIR, root=jpegs, last_batch=last_batch,
                                                           epochs=epochs, k=k)))  # fmt: skip
    state = tmp_path / "state.pt"

    def run(*args):
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return eval(proc.stdout.split("IDS ", 1)[1])

    run("save", str(state))
    resumed = run("load", str(state))
    # The uninterrupted run, in this process: the same seed gives the same order.
    dl = loader(jpegs, 4, output_map=("images", "labels"), shuffle=True, seed=7, last_batch=last_batch)
    for _ in range(epochs - 1):
        epoch(dl)
    whole = [epoch(dl), epoch(dl)]
    assert resumed == [whole[0][k:], whole[1]]
    assert whole[0][:k] != whole[0][k:k + k]  # shuffled: the check is not trivially true


def test_a_state_from_another_loader_is_refused(jpegs):
    """load_state_dict names what differs (batch size here) instead of resuming somewhere else."""
    state = loader(jpegs, 4).state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 4, now 5"):
        loader(jpegs, 5).load_state_dict(state)
    with pytest.raises(ValueError, match="not a DALILoader state"):
        loader(jpegs, 4).load_state_dict({"epoch": 0})


def test_a_made_pipeline_iterates_but_cannot_be_restored(jpegs):
    """A Pipeline object is used as it is; restoring needs the pipeline_def (DALI restores only at build)."""
    paths, labels = _dali.files_and_labels(jpegs)
    pipe = plain(batch_size=8, num_threads=1, device_id=None, files=paths, labels=labels, enable_checkpointing=True)
    dl = DALILoader(pipe, ("images", "labels"))
    assert len(dl) == 3 and [x for b in dl for x in _dali.ids(b)] == ALL
    with pytest.raises(ValueError, match="pass the @pipeline_def function"):
        dl.load_state_dict(dl.state_dict())


TORCHRUN_SCRIPT = """
import json, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
import test_dali as t
dist.init_process_group("gloo")
dl = t.loader({root!r}, 4, shuffle=True, seed=3)
epochs = [[x for b in dl for x in t._dali.ids(b)] for _ in range(2)]
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {{"len": len(dl), "epochs": epochs, "shard": dl.state_dict()["shard"]}})
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.hang_limit(180)
def test_torchrun_two_ranks_read_their_own_shards(jpegs, tmp_path):
    """torchrun --nproc_per_node 2 (gloo): each rank reads its shard, the lens agree, the shards cover the data."""
    import json

    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT.format(tests=TESTS_DIR, root=jpegs)))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert [r["shard"] for r in ranks] == [[0, 2], [1, 2]]
    assert ranks[0]["len"] == ranks[1]["len"] == 3  # 11 samples per shard (21 padded to 22), 4 per batch
    for e in range(2):
        a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
        assert len(a) == len(b) == 11 and set(a) | set(b) == set(ALL)


def test_a_pipeline_without_shard_parameters_is_refused_under_several_ranks(jpegs, monkeypatch):
    """Sharding needs somewhere to go: the error says which parameters to declare, or auto_shard=False."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")

    @pipeline_def
    def unsharded(root):
        jpegs, label = fn.readers.file(file_root=root, pad_last_batch=True, name="Reader")
        return label

    with pytest.raises(ValueError, match="no shard_id / num_shards parameter"):
        DALILoader(unsharded, ("labels",), batch_size=4, num_threads=1, root=jpegs)
    dl = DALILoader(unsharded, ("labels",), batch_size=4, num_threads=1, root=jpegs, auto_shard=False)
    assert len(dl) == 6


@pytest.mark.parametrize("reader_kwargs,name,match", [
    ({"pad_last_batch": False}, "Reader", "pass pad_last_batch=True"),
    ({"pad_last_batch": True}, "Files", r"its readers are named \['Reader'\]"),
])  # fmt: skip
def test_a_reader_it_cannot_count_epochs_with_is_refused(jpegs, reader_kwargs, name, match):
    """Epochs need the named reader, padding its last batch: otherwise a clear error says what to pass."""

    @pipeline_def
    def p(root):
        _, label = fn.readers.file(file_root=root, name="Reader", **reader_kwargs)
        return label

    with pytest.raises(ValueError, match=match):
        len(DALILoader(p, ("labels",), batch_size=4, num_threads=1, root=jpegs, reader_name=name))


def test_bad_arguments_are_refused_with_what_to_do(jpegs):
    """last_batch, output_map, device and the pipeline's type are checked when the loader is made."""
    with pytest.raises(ValueError, match="last_batch must be one of"):
        loader(jpegs, last_batch="fill")
    with pytest.raises(TypeError, match="output_map must be"):
        loader(jpegs, output_map="images")
    with pytest.raises(TypeError, match="DALI Pipeline or a @pipeline_def"):
        DALILoader(lambda: None, ("x",), batch_size=2)
    with pytest.raises(TypeError, match="needs batch_size"):
        DALILoader(plain, ("x",), files=[], labels=[])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            loader(jpegs, device="cuda")
    with pytest.raises(ValueError, match="has 2 outputs but output_map names 1"):
        next(iter(loader(jpegs, output_map=("images",))))


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as on a two-GPU machine whose current device is cuda:1 (set_device(1)); nothing else of CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_device_cuda_means_the_current_device_for_the_pipeline_too(jpegs, two_gpus):
    """device="cuda" after set_device(1): batches go to cuda:1 and the pipeline's device_id is 1, not GPU 0;
    an explicit index is kept, and one this process cannot see is refused naming the devices it can."""
    dl = loader(jpegs, device="cuda", numa="off")
    assert dl.device == torch.device("cuda", 1) and dl._kwargs["device_id"] == 1
    dl = loader(jpegs, device="cuda:0", numa="off")
    assert dl.device == torch.device("cuda", 0) and dl._kwargs["device_id"] == 0
    with pytest.raises(ValueError, match=r"sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        loader(jpegs, device="cuda:2", numa="off")


def test_cpu_outputs_for_the_gpu_wait_in_pinned_buffers_until_their_copy_completed(jpegs, two_gpus, monkeypatch):
    """A CPU pipeline with device="cuda": each output is copied to the GPU from a pinned buffer, and no buffer is
    rewritten while its copy is queued (the GPU never catches up here); the same run with copies reported done at
    once (no guard) gives wrong batches, so the check can fail."""
    from fastfeed.dali import staging

    def run(fake):
        monkeypatch.setattr(staging, "CUDA", fake)
        dl = loader(jpegs, device="cuda", device_id=None, numa="off")
        batches = list(dl)  # no copy has completed unless staging waited for it
        fake.complete()
        return batches

    fake = _dali.FakeCuda()
    batches = run(fake)
    assert [x for b in batches for x in _dali.ids(b)] == ALL
    assert [y for b in batches for y in b[1].tolist()] == [0] * 7 + [1] * 7 + [2] * 7
    # 6 batches, 2 outputs: 4 buffers each, and the 5th and 6th batches waited for the 1st's and 2nd's copies.
    assert len(fake.pinned_buffers) == 2 * staging.DEPTH and fake.waits == 2 * 2
    unguarded = _dali.FakeCuda()
    unguarded.done = lambda event: True
    assert [x for b in run(unguarded) for x in _dali.ids(b)] != ALL


def test_pinned_buffers_are_reused_when_the_gpu_keeps_up(jpegs, two_gpus, monkeypatch):
    """Copies that complete before the next batch: one pinned buffer per output serves every batch of every epoch,
    the last, shorter batch included, and nothing waits."""
    from fastfeed.dali import staging

    fake = _dali.FakeCuda()
    monkeypatch.setattr(staging, "CUDA", fake)
    dl = loader(jpegs, device="cuda", device_id=None, numa="off")
    for _ in range(2):
        seen = []
        for batch in dl:
            fake.complete()
            seen += _dali.ids(batch)
        assert seen == ALL
    assert len(fake.pinned_buffers) == 2 and fake.waits == 0


def test_outputs_of_different_shapes_get_a_clear_error(tmp_path):
    """DALI batches of ragged images cannot become one tensor: the error says to resize or crop in the pipeline."""
    root = _dali.make_folder(tmp_path / "a", classes=("a",), per_class=2, size=(8, 8))
    _dali.make_folder(tmp_path / "a", classes=("b",), per_class=2, size=(12, 8))
    with pytest.raises(ValueError, match="different shapes.*resize or crop"):
        next(iter(loader(root, batch_size=4)))


def test_image_classification_labels_are_imagefolders(tmp_path):
    """The class indices and file order are ImageFolder's, on a layout with its corner cases (case, nesting,
    hidden folders, non-image files, symlinked folders, extensions); against torchvision when it imports."""
    root = tmp_path / "tricky"
    src = _dali.make_folder(tmp_path / "src", classes=("x",), per_class=7)
    for folder in ("B", "a/sub/deeper", "c", ".hidden", "Zeta"):
        (root / folder).mkdir(parents=True)
    copies = {"B/x.JPG": 0, "a/sub/deeper/y.jpeg": 1, "a/z.png": 2, "c/10.jpg": 3, "c/9.jpg": 4, ".hidden/h.jpg": 5,
              "Zeta/q.webp": 6}  # fmt: skip
    for name, i in copies.items():
        (root / name).write_bytes(open(os.path.join(src, "x", f"{i}.jpg"), "rb").read())
    (root / "a" / "readme.txt").write_text("not an image")
    os.symlink("../c", root / "Zeta" / "link")
    paths, labels, classes = folders.image_folder(str(root))
    expected = [(".hidden/h.jpg", 0), ("B/x.JPG", 1), ("Zeta/q.webp", 2), ("Zeta/link/10.jpg", 2),
                ("Zeta/link/9.jpg", 2), ("a/z.png", 3), ("a/sub/deeper/y.jpeg", 3), ("c/10.jpg", 4),
                ("c/9.jpg", 4)]  # torchvision 0.28's ImageFolder on this tree  # fmt: skip
    assert [(os.path.relpath(p, root), y) for p, y in zip(paths, labels)] == expected
    assert classes == [".hidden", "B", "Zeta", "a", "c"]
    try:
        from torchvision.datasets import ImageFolder
    except Exception:  # absent, or a build that does not match this torch
        ImageFolder = None
    if ImageFolder is not None:
        assert ImageFolder(str(root)).samples == list(zip(paths, labels))
    # Through DALI, in order (evaluation): the labels arrive as ImageFolder's targets would.
    dl = ffdali.image_classification(str(root), batch_size=4, crop=16, train=False, num_threads=1)
    assert [y for _, b in dl for y in b.tolist()] == labels


@pytest.mark.parametrize("layout,dtype,shape", [("NCHW", torch.float32, (4, 3, 16, 16)),
                                                ("NHWC", torch.uint8, (4, 16, 16, 3))])  # fmt: skip
def test_image_classification_yields_normalised_crops(jpegs, layout, dtype, shape):
    """Training batches: the crop, layout and dtype asked for; float32 normalised by mean/std, uint8 as decoded."""
    torch.manual_seed(0)
    dl = ffdali.image_classification(jpegs, batch_size=4, crop=16, layout=layout, dtype=dtype, num_threads=1,
                                     mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))  # fmt: skip
    batches = list(dl)
    assert len(batches) == len(dl) == 6 and batches[0][0].shape == shape and batches[0][0].dtype == dtype
    assert sorted(y for _, b in batches for y in b.tolist()) == sorted([0] * 7 + [1] * 7 + [2] * 7)
    images = torch.cat([x for x, _ in batches]).float()
    if dtype == torch.uint8:
        assert 0 <= images.min() and images.max() <= 30  # pixel values 0..26, as written
    else:
        assert images.max() < -1.5  # (v / 255 - 0.5) / 0.25 for v <= 26


def test_image_classification_errors_name_the_problem(tmp_path, jpegs):
    """Empty folders, classes without images, missing paths and GPU decoding without CUDA: clear errors."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        ffdali.image_classification(str(tmp_path / "empty"), batch_size=2)
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    (tmp_path / "noimg" / "a" / "x.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes a"):
        ffdali.image_classification(str(tmp_path / "noimg"), batch_size=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ffdali.image_classification(str(tmp_path / "nope"), batch_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="nvJPEG on a CUDA GPU"):
            ffdali.image_classification(jpegs, batch_size=2, device="gpu")
    with pytest.raises(ValueError, match="layout must be one of"):
        ffdali.image_classification(jpegs, batch_size=2, layout="CHW")


def test_corrupt_images_are_fatal_or_skipped_by_choice(tmp_path):
    """A garbled and a truncated JPEG: on_corrupt='raise' names both; 'skip' leaves them out, warning by name."""
    root = _dali.make_folder(tmp_path / "imgs")
    garbled, truncated = os.path.join(root, "dog", "3.jpg"), os.path.join(root, "dog", "4.jpg")
    data = open(garbled, "rb").read()
    open(garbled, "wb").write(data[:20] + b"\x00" * 200)
    whole = open(truncated, "rb").read()
    open(truncated, "wb").write(whole[:-40])  # headers whole, the end cut off
    with pytest.raises(folders.CorruptImageError, match=r"2 of 21 .*dog/3\.jpg: corrupt JPEG.*dog/4\.jpg: truncated"):
        ffdali.image_classification(root, batch_size=4, num_threads=1)
    with pytest.warns(RuntimeWarning, match=r"skipping 2 of 21 .*dog/3\.jpg"):
        dl = ffdali.image_classification(root, batch_size=4, crop=16, train=False, num_threads=1,
                                         on_corrupt="skip")  # fmt: skip
    assert sum(len(y) for _, y in dl) == 19


def test_importing_without_dali_names_the_extra():
    """Without NVIDIA DALI, import fastfeed.dali raises ImportError naming pip install 'fastfeed[dali]'."""
    code = ("import sys\nsys.modules['nvidia.dali'] = None\n"
            "try:\n import fastfeed.dali\nexcept ImportError as e:\n print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'fastfeed[dali]'" in out


def _dali_threads() -> dict:
    """This process's threads other than the calling one: {tid: allowed CPUs}."""
    me = __import__("threading").get_native_id()
    out = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
            except OSError:
                pass
    return out


def test_dali_threads_run_on_the_plans_cpus_and_the_loop_keeps_its_own(jpegs):
    """numa=0: the threads DALI starts get the plan's worker CPUs; the calling thread gets its CPUs back."""
    from fastfeed import affinity

    plan = affinity.plan_for(0, None, 2)
    if not plan.worker_cpus or plan.worker_cpus == set(os.sched_getaffinity(0)):
        pytest.skip("needs a plan that keeps a CPU for the training loop (2 CPUs or more)")
    mine = os.sched_getaffinity(0)
    before = _dali_threads()
    dl = loader(jpegs, numa=0, num_threads=2)
    len(dl)  # builds the pipeline
    new = {tid: cpus for tid, cpus in _dali_threads().items() if tid not in before}
    assert new and all(cpus == plan.worker_cpus for cpus in new.values()), (new, plan.worker_cpus)
    assert os.sched_getaffinity(0) == mine
    dl.close()


def test_stats_and_the_doctor_read_a_dali_loader(jpegs):
    """stats() counts the epoch's batches; the doctor's watch records the loader as DALI's, with its knobs."""
    from fastfeed import doctor

    dl = loader(jpegs)
    list(dl)
    st = dl.stats()
    assert st.batches == 6 and st.num_workers == 1 and st.prefetch_factor == 2
    with doctor.watch(steps=10) as report:
        dl2 = loader(jpegs)
        for _ in range(3):
            for _ in dl2:
                pass
    d = report.to_dict()
    assert d["loader"]["kind"] == "dali" and d["steps"]["batches"] == 10
    assert "DALILoader made at test_dali.py" in report.summary() and "num_threads=1" in report.summary()


def test_tune_chooses_threads_and_queue_depth(jpegs):
    """fastfeed.dali.tune runs the tuner's search over num_threads / prefetch_queue_depth on fresh pipelines."""
    paths, labels = _dali.files_and_labels(jpegs)
    result = ffdali.tune(plain, ("images", "labels"), batch_size=4, files=paths, labels=labels, budget_s=20,
                         max_threads=2)  # fmt: skip
    assert result.worker_type == "dali" and 1 <= result.num_workers <= 2 and result.prefetch_factor >= 1
    assert all(t.setting.worker_type == "dali" for t in result.trials)
    with pytest.raises(ValueError, match="tune\\(\\) chooses num_threads"):
        ffdali.tune(plain, ("images",), batch_size=4, num_threads=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (nvJPEG)")
def test_gpu_decoding_yields_cuda_batches_with_the_cpu_labels(jpegs):
    """device='gpu': nvJPEG ("mixed") decoding, batches on this GPU, the same labels as the CPU pipeline's."""
    gpu = ffdali.image_classification(jpegs, batch_size=4, crop=16, train=False, device="gpu", num_threads=1)
    cpu = ffdali.image_classification(jpegs, batch_size=4, crop=16, train=False, device="cpu", num_threads=1)
    got = [(x, y) for x, y in gpu]
    assert all(x.is_cuda and y.is_cuda for x, y in got)
    assert [y.tolist() for _, y in got] == [y.tolist() for _, y in cpu]


def test_png_files_are_checked_by_signature_and_end_chunk(tmp_path):
    """A whole PNG passes; one cut before its IEND chunk is named as truncated."""
    from PIL import Image

    path = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(path)
    assert folders.problem(str(path)) is None
    path.write_bytes(path.read_bytes()[:-20])
    assert folders.problem(str(path)) == "truncated PNG (no IEND chunk)"
    assert folders.problem(str(tmp_path / "missing.jpg")).startswith("unreadable")
