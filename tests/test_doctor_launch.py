"""fastfeed doctor's launcher (``fastfeed.doctor.launch``): each launch of a job under a rendezvous id and store
prefix of its own, alike on every node, and a job that launches though the port picked for its store is taken."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import run as torchrun

from fastfeed.cli import main
from fastfeed.doctor import jobstore, launch

HERE = Path(__file__).parent
SCRIPT = str(HERE / "_rdzv_job.py")
CLOSING = {"change": "num_workers=2", "setting": {"num_workers": 2}, "rank": 1, "predicted_gain": 1.5,
           "predicted_samples_per_s": 100.0}  # fmt: skip


def _launches(monkeypatch, nnodes: int, node_rank: int, endpoint: str | None,
              rdzv_id: str | None = None) -> list[list[str]]:  # fmt: skip
    """torchrun's arguments of each launch ``examine_job`` makes, the measured one advising a closing setting."""
    made = []

    def record(args: list[str], directory: str) -> None:
        made.append(args)
        if len(made) == 1:
            (Path(directory) / "decision.json").write_text(json.dumps({"closing": CLOSING}))

    monkeypatch.setattr(launch, "launch", record)
    assert launch.examine_job(2, nnodes, node_rank, endpoint, SCRIPT, [], False, 8, True, rdzv_id) is None
    return made


def _prefix(args: list[str]) -> str:
    """The store prefix of the ranks of a launch made with ``args``, from the run id torchrun hands them."""
    rdzv_id = torchrun.get_args_parser().parse_args(args).rdzv_id
    return jobstore.run_prefix({"TORCHELASTIC_RUN_ID": rdzv_id, "TORCHELASTIC_RESTART_COUNT": "0"})


def test_each_launch_of_a_job_has_a_store_prefix_of_its_own_alike_on_every_node(monkeypatch):
    """The measured and the closing launch run under distinct rendezvous ids, so distinct store prefixes, and
    both nodes of a two-node job derive the same ones."""
    one = [_prefix(a) for a in _launches(monkeypatch, 1, 0, None)]
    assert len(one) == 2 and one[0] != one[1], one
    nodes = [[_prefix(a) for a in _launches(monkeypatch, 2, rank, "10.0.0.1:29400")] for rank in (0, 1)]
    assert nodes[0] == nodes[1] and len(set(nodes[0])) == 2, nodes
    assert all(p.startswith("fastfeed/doctor/") and p.endswith("/0/") for p in one + nodes[0]), (one, nodes)


def test_a_given_rdzv_id_names_both_launches_on_every_node(monkeypatch):
    """``--rdzv-id`` (given alike to every node, as torchrun's) is the job's part of each launch's id, whatever
    each node calls node 0."""
    nodes = [[_prefix(a) for a in _launches(monkeypatch, 2, rank, endpoint, "exp-7")]
             for rank, endpoint in ((0, "127.0.0.1:29400"), (1, "node0:29400"))]  # fmt: skip
    assert nodes[0] == nodes[1] == ["fastfeed/doctor/exp-7-measured/0/", "fastfeed/doctor/exp-7-closing/0/"], nodes


def test_an_rdzv_id_that_cannot_name_store_keys_is_refused_naming_it(capsys):
    """An ``--rdzv-id`` with a character other than letters, digits, '.', '_' and '-' stops the doctor before any
    launch, with an error that names the option and the value."""
    assert main(["doctor", "--nproc-per-node", "2", "--rdzv-id", "a/b", SCRIPT]) == 1
    assert "--rdzv-id 'a/b': use letters, digits" in capsys.readouterr().err


def test_a_taken_port_the_user_named_fails_the_job_saying_so():
    """A ``--rdzv-endpoint`` whose port another process holds is not swapped for another: the doctor fails before
    any rank starts, saying the store's port is held."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        proc = subprocess.run([sys.executable, "-m", "fastfeed", "doctor", "--nproc-per-node", "2", "--rdzv-endpoint",
                               f"127.0.0.1:{held.getsockname()[1]}", SCRIPT],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fastfeed doctor: the job's store could not listen on its port: another process holds it" in proc.stderr
    assert "EADDRINUSE" in proc.stderr and "rendezvous" not in proc.stdout, proc.stdout + proc.stderr


# Two launches of a job, 13 s on 2 idle cores and many times that on busy ones: a guard against hangs of four
# minutes, which tests/conftest.py stretches with the machine's load (up to 4x), rather than the default minute; the
# driver's own timeout is the backstop past the most it stretches to.
LAUNCHES_HANG_S = 240


@pytest.mark.hang_limit(LAUNCHES_HANG_S)
def test_a_jobs_two_launches_run_though_the_port_picked_for_each_is_taken(tmp_path):
    """With the port first picked for each launch's store held by another process (the race between picking a
    free port and binding it, lost), both launches of the job still run, each on another port and under its own
    rendezvous id, and the report has the closing launch's result."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(HERE / "_doctor_launch_driver.py"), str(out), SCRIPT],
                          capture_output=True, text=True, timeout=4 * LAUNCHES_HANG_S + 30)  # fmt: skip
    said = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, said
    held = int(re.search(r"^held port (\d+)$", proc.stdout, re.M)[1])
    assert "held port picked 2 times" in proc.stdout, said
    ranks = re.findall(r"^rank (\d) rendezvous (\S+) port (\d+)$", proc.stdout, re.M)
    by_id: dict[str, set] = {}
    for rank, rdzv_id, port in ranks:
        assert int(port) != held, said
        by_id.setdefault(rdzv_id, set()).add(int(rank))
    assert list(by_id.values()) == [{0, 1}, {0, 1}], said
    measured, closing = by_id
    assert measured.endswith("-measured") and closing.endswith("-closing"), by_id
    report = json.loads((out / "report.json").read_text())
    assert report["whatif"]["closing"]["setting"] == {"num_workers": 0}, report["whatif"]
