"""The exclusion file as schedulers read it, and ``doctor --exclude-file`` at the edge (issue 23, items 1
and 6; docs/reliability.md, "Exclusion file").

A finding is real measurements judged by ``doctor --load`` (the command a user reruns on saved
measurements); the disks are real 2 MiB tmpfs mounts, skipped where mounting is not allowed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from reliability_runs import ROOT, job_env

from hyperacc.remediation.exclusion import add_exclusions, read_exclusions

sys.path.insert(0, str(ROOT / "tests" / "loop"))
from doctor_docs import make_doc  # noqa: E402

SLOW_HOST = "host1"  # rank 3 of make_doc(nodes=4, per_node=2) lives on host1


def _saved(path: Path) -> Path:
    doc = make_doc(nodes=4, per_node=2, slow=lambda rank, node, fig, r: 1.6 if rank == 3 else 1.0)
    path.write_text(json.dumps(doc))
    return path


def _doctor(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hyperacc", "doctor", *args], env=job_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _paste(path: Path) -> str:
    return subprocess.run(["paste", "-sd,", str(path)], capture_output=True, text=True, check=True).stdout.strip()


def test_a_hand_written_file_without_a_final_newline_keeps_its_host(tmp_path: Path) -> None:
    exclude = tmp_path / "hosts.exclude"
    exclude.write_text("nodeX")  # printf 'nodeX' > hosts.exclude
    res = _doctor("--load", str(_saved(tmp_path / "m.json")), "--exclude-file", str(exclude))
    assert res.returncode == 1, res.stderr
    assert exclude.read_text() == f"nodeX\n{SLOW_HOST}\n"  # one host per line, nothing else on it
    assert read_exclusions(exclude) == ["nodeX", SLOW_HOST]
    assert _paste(exclude) == f"nodeX,{SLOW_HOST}"  # the documented $(paste -sd, FILE)
    again = _doctor("--load", str(_saved(tmp_path / "m.json")), "--exclude-file", str(exclude))
    assert again.returncode == 1 and exclude.read_text() == f"nodeX\n{SLOW_HOST}\n"  # no duplicates


def test_comments_stay_on_their_own_lines(tmp_path: Path) -> None:
    exclude = tmp_path / "hosts.exclude"
    exclude.write_text("# left out by the operators\nnodeA  # flaky NIC\nnodeA\n\nnodeB")
    assert add_exclusions(exclude, ["nodeC", "nodeA", "nodeC"]) == ["nodeC"]
    lines = exclude.read_text().splitlines()
    assert lines == ["# left out by the operators", "# flaky NIC", "nodeA", "nodeB", "nodeC"]
    assert all(line.startswith("#") or line.split() == [line] for line in lines)
    assert read_exclusions(exclude) == ["nodeA", "nodeB", "nodeC"]
    with pytest.raises(ValueError, match="not a host name"):
        add_exclusions(exclude, ["node D"])
    with pytest.raises(ValueError, match="not a host name"):
        add_exclusions(exclude, ["nodeE,nodeF"])
    assert read_exclusions(exclude) == ["nodeA", "nodeB", "nodeC"]  # a refused write changes nothing


def test_writers_in_many_processes_lose_nothing_and_leave_nothing(tmp_path: Path) -> None:
    exclude = tmp_path / "hosts.exclude"
    code = ("import sys; from hyperacc.remediation.exclusion import add_exclusions\n"
            "for i in range(25): add_exclusions(sys.argv[1], [f'w{sys.argv[2]}-{i}', 'shared'])")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code, str(exclude), str(w)], env=job_env()) for w in range(4)]
    seen_torn = []

    def read_while_writing() -> None:  # a reader never sees half a file
        while any(p.poll() is None for p in procs):
            text = exclude.read_text() if exclude.exists() else ""
            if text and not text.endswith("\n"):
                seen_torn.append(text)

    reader = threading.Thread(target=read_while_writing)
    reader.start()
    assert all(p.wait(timeout=120) == 0 for p in procs)
    reader.join()
    names = exclude.read_text().splitlines()
    assert sorted(names) == sorted(["shared", *(f"w{w}-{i}" for w in range(4) for i in range(25))])
    assert not seen_torn
    assert sorted(os.listdir(tmp_path)) == ["hosts.exclude"]  # no temporary file left behind


def test_an_exclusion_file_that_cannot_be_written_fails_before_measuring(tmp_path: Path) -> None:
    for bad, why in (("/proc/x", "cannot create files in /proc"), (str(tmp_path), "directory"),
                     ("/dev/null", "not a regular file")):  # fmt: skip
        res = _doctor("--nproc-per-node", "1", "--seconds", "30", "--exclude-file", bad, timeout=60)
        assert res.returncode == 2, res.stderr
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "'--exclude-file'" in lines[0] and why in lines[0], res.stderr
        assert "measuring" not in res.stderr + res.stdout


def test_a_finding_is_printed_when_the_full_disk_refuses_the_exclusion_file(tmp_path: Path, small_fs: Path) -> None:
    from test_filesystem_and_ports import _fill

    saved = _saved(tmp_path / "m.json")
    _fill(small_fs)  # an empty file can still be created (the check at the edge passes); its bytes cannot
    for as_json in (False, True):
        res = _doctor("--load", str(saved), "--exclude-file", str(small_fs / "hosts.exclude"),
                      *(["--json"] if as_json else []))  # fmt: skip
        assert res.returncode == 2, res.stderr
        if as_json:
            doc = json.loads(res.stdout)
            assert doc["exclude_hosts"] == [SLOW_HOST] and doc["findings"]
            assert "No space left" in doc["exclude_file"]["error"]
        else:
            flat = " ".join(res.stdout.split())  # the terminal wraps the long path's line anywhere
            assert "Rank 3 (node 1, host host1) is slow" in flat and "not written" in flat
        assert "cannot write --exclude-file" in res.stderr and SLOW_HOST in res.stderr.splitlines()[-1]


def test_a_finding_is_printed_when_the_disk_turns_read_only(tmp_path: Path, small_fs: Path) -> None:
    """The disk is fine when doctor starts and read-only when it has judged: the measurements arrive
    through a named pipe, so the test remounts the disk exactly between the two."""
    pipe = tmp_path / "measurements.fifo"
    os.mkfifo(pipe)
    measurements = json.dumps(make_doc(nodes=4, per_node=2, slow=lambda rank, node, fig, r: 1.6 if rank == 3 else 1.0))
    for as_json in (False, True):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hyperacc", "doctor", "--load", str(pipe), "--exclude-file",
             str(small_fs / "hosts.exclude"), *(["--json"] if as_json else [])],
            env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with open(pipe, "w") as fh:  # opens once doctor reads: its options were checked by then
            subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
            fh.write(measurements)
        out, err = proc.communicate(timeout=120)
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
        assert proc.returncode == 2, err
        if as_json:
            doc = json.loads(out)
            assert doc["exclude_hosts"] == [SLOW_HOST] and "Read-only" in doc["exclude_file"]["error"]
        else:
            assert "Rank 3 (node 1, host host1) is slow" in out and "Evidence" in out
        assert "cannot write --exclude-file" in err and SLOW_HOST in err
        assert not (small_fs / "hosts.exclude").exists()
