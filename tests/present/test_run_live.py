"""`hyperacc run` while the job trains: the live panel in a terminal (driven through tmux), one line per
window in a pipe, torchrun's own exit status, signals passed on, and the Prometheus endpoint of rank 0
scraped with a real HTTP client."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from hyperacc import store

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
HYPERACC = [sys.executable, "-m", "hyperacc"]
SMALL = ["--features", "64", "--hidden", "64", "--batch-size", "16"]
# segments every half second, so the view has something to show before a short job ends
TRACE = '{"flush_every_s": 0.5}'


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HYPERACC_RUN_DIR", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failing_script(tmp_path: Path) -> Path:
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, time\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(1)\n"
    )
    return script


def test_lines_in_a_pipe_and_the_exit_status_of_torchrun(tmp_path):
    run = subprocess.run(
        [*HYPERACC, "run", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", "--trace", TRACE, "--",
         str(EXAMPLE), "--steps", "300", *SMALL],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() if x.startswith("hyperacc live: step ")]
    assert lines, run.stdout[-3000:]
    assert "2/2 ranks" in lines[-1] and "steps/s" in lines[-1] and "p99" in lines[-1]
    assert lines[-1].startswith("hyperacc live: step 299,")  # the last line covers the end of the run

    # a rank that fails: the same exit status as torchrun started by hand
    script = _failing_script(tmp_path)
    ours = subprocess.run(
        [*HYPERACC, "run", "--run-dir", str(tmp_path / "failed"), "--nproc-per-node", "2", "--", str(script)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode != 0
    assert ours.returncode == plain.returncode, ours.stdout[-2000:] + ours.stderr[-2000:]


@pytest.fixture(scope="module")
def served_then_stopped(tmp_path_factory) -> dict:
    """One endless job serves two tests: rank 0's Prometheus endpoint is scraped while it trains, then
    ``hyperacc run`` gets SIGTERM. Returns the last scrape, the exit status, the output and the
    processes of the job left afterwards."""
    work = tmp_path_factory.mktemp("served")
    run_dir, log_path = work / "run", work / "job.log"
    port = _free_port()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*HYPERACC, "run", "--run-dir", str(run_dir), "--nproc-per-node", "2", "--metrics-port", str(port),
             "--trace", TRACE, "--", str(EXAMPLE), "--steps", "1000000", *SMALL],
            env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    body, wrote, agent_serves = "", False, False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                body = ""
            if 'hyperacc_last_step{rank="0"}' in body and 'hyperacc_last_step{rank="1"}' in body:
                # served by hyperacc run itself (the node agent), not by a training rank
                listening = psutil.Process(proc.pid).net_connections(kind="tcp")
                agent_serves = any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in listening)
                break
            time.sleep(1.0)
        while time.monotonic() < deadline and proc.poll() is None and not wrote:
            wrote = any(store.segment_range(p) for p in run_dir.glob("steps/rank-*/seg-*"))
            time.sleep(0.5)
        running = proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    return {"body": body, "wrote": wrote, "running": running, "code": proc.returncode, "agent_serves": agent_serves,
            "out": log_path.read_text(errors="replace"), "left": left.stdout.strip()}  # fmt: skip


def test_sigterm_is_passed_to_torchrun_and_the_ranks_stop(served_then_stopped):
    job = served_then_stopped
    assert job["wrote"] and job["running"], "the job never wrote a step:\n" + job["out"][-2000:]
    assert job["code"] != 0, job["out"][-2000:]
    # torchrun stopped its workers: no rank of this job is left
    assert job["left"] == "", job["left"]


def test_metrics_of_every_rank_from_the_node_agent(served_then_stopped):
    body = served_then_stopped["body"]
    assert 'hyperacc_last_step{rank="0"}' in body and 'hyperacc_last_step{rank="1"}' in body, body[-2000:]
    assert 'hyperacc_step_seconds_count{rank="1"}' in body
    assert served_then_stopped["agent_serves"]  # hyperacc run's own process listens, no training rank


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make system installs it)")
def test_the_live_panel_in_a_terminal(tmp_path):
    session = f"hyperacc-test-{os.getpid()}"
    rc_file = tmp_path / "rc"
    command = " ".join([
        *HYPERACC, "run", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", "--trace", f"'{TRACE}'",
        "--", str(EXAMPLE), "--steps", "800", *SMALL, "--log-every", "400",
    ])  # fmt: skip
    env = _env()
    env["TERM"] = "xterm-256color"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50",
                    f"{command}; echo $? > {rc_file}; sleep 600"], env=env, check=True)  # fmt: skip
    screen = ""
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout  # fmt: skip
            if "hyperacc live:" in screen and "steps/s" in screen and "ranks 2/2" in screen:
                break
            time.sleep(1.0)
        panel = screen
        while time.monotonic() < deadline and not rc_file.exists():
            time.sleep(1.0)
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-S", "-200", "-t", session], capture_output=True,
                                text=True).stdout  # fmt: skip
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "hyperacc live:" in panel and "ranks 2/2" in panel, panel
    for header in ("rank", "self ms", "wait ms", "culprit"):
        assert header in panel, panel
    assert rc_file.read_text().strip() == "0", screen
    assert "loss" in screen  # the job's own output is shown above the panel


def test_output_lines_keep_the_latest_state_of_a_progress_bar():
    from hyperacc.supervisor import OutputLines

    lines = OutputLines()
    assert lines.feed(b"epoch 1\n 10%|#   \r 50%|#####") == ["epoch 1"]
    assert lines.feed(b"     \r100%|##########|\nloss 0.5\r\n") == ["100%|##########|", "loss 0.5"]
    assert lines.feed(b"caf\xc3") == [] and lines.feed(b"\xa9 \xff\n") == ["caf\u00e9 \ufffd"]
    assert lines.feed(b"no newline at the end") == [] and lines.close() == ["no newline at the end"]
    assert lines.close() == []


def test_output_lines_equal_the_whole_output_split_at_once_for_any_chunking():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hyperacc.supervisor import OutputLines

    def reference(data: bytes) -> list[str]:
        *done, rest = data.split(b"\n")
        rest_line = [rest] if rest else []
        texts = [line[:-1] if line.endswith(b"\r") else line for line in done]
        out = [t.rsplit(b"\r", 1)[-1].decode(errors="replace") for t in texts]
        tail = [t[:-1] if t.endswith(b"\r") else t for t in rest_line]
        return out + [t for t in (x.rsplit(b"\r", 1)[-1].decode(errors="replace") for x in tail) if t]

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from([b"a", b"bc", b"\r", b"\n", b"\r\n", b"\xc3", b"\xa9"]), max_size=40),
           st.lists(st.integers(min_value=0, max_value=40), max_size=8))
    def check(tokens: list[bytes], cuts: list[int]) -> None:
        data = b"".join(tokens)
        bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
        lines = OutputLines()
        got = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            got += lines.feed(data[lo:hi])
        got += lines.close()
        assert got == reference(data)

    check()


def test_output_lines_keep_only_the_latest_redraw_in_memory():
    from hyperacc.supervisor import OutputLines

    lines = OutputLines()
    for i in range(20_000):
        assert lines.feed(b"\r" + f"{i:>6d} it".encode() * 10) == []
    assert sum(map(len, lines._parts)) <= 100  # one redraw's worth, not the whole history
    assert lines.feed(b"\n") == [" 19999 it" * 10]
