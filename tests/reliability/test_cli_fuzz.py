"""Every command's options, fuzzed (hypothesis): exit 0, 1 or 2, one line of error, never a traceback
(docs/reliability.md, "Command-line input").

Each example is a short list of options of one command, each with a value drawn from numbers at and
beyond their edges (NaN, infinities, 1e308, huge and negative integers), malformed text and random
text; the options are read from the command itself, so a new option is fuzzed without a change here.
Commands run in-process through click's runner, inside a scratch directory; ``run`` with
``--dry-run`` (nothing is launched). ``test_sample_as_subprocesses`` runs a sample as real
processes under a memory limit and a time limit.

``HYPERACC_FUZZ_EXAMPLES`` sets the examples per command (default 40; bench/soak.py runs more).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_runs import ROOT, check_cli_result, small_run

from hyperacc.cli import COMMANDS, LazyGroup, cli

EXAMPLES = int(os.environ.get("HYPERACC_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # hangs are caught by the test timeout; speed is not judged here
    derandomize=os.environ.get("HYPERACC_FUZZ_RANDOM") != "1",  # the same inputs on every CI run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

EDGE = [
    "0", "-1", "1", "2", "3", "0.5", "-0.5", "1e-308", "nan", "NaN", "-nan", "inf", "-inf", "Infinity",
    "1e308", "-1e308", "1e400", "1e12", "10000001", "4097", "65536", "99999999999999999999999",
    "-99999999999999999999", "9" * 5000, "", " ", "abc", "1,2", "3/5", "0/0", "7/5", "-3/5", "1:2", "2:1",
    ":", "0:10", "\u0663", "0x10", "1_000", "True", "null", "{}", "[]", '{"a": 1}', "'", '"', "--", "-",
]  # fmt: skip
VALUES = st.one_of(
    st.sampled_from(EDGE),
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
# Paths stay inside the scratch directory (a command may write wherever it is allowed to): w/file is
# a regular file, w/fifo a named pipe (a device stand-in). The one place outside is /proc, where
# nothing can be created.
PATHS = st.one_of(
    st.sampled_from(["", " ", ".", "out", "out/", "a/b/c/out.html", "out.png", "out.html", "out.json", "run",
                     "nope/x.png", "w/file", "w/file/x", "w/file/x.html", "w/fifo", "w/fifo/x", "/proc/x",
                     "/proc/x/y.html"]),  # fmt: skip
    st.text(alphabet="abc._-/ ", min_size=1, max_size=10).map(lambda t: "w/" + t),
)
JSONISH = st.one_of(
    st.sampled_from(["0", "1", "2", "true", "{}", "[]", "{oops", '{"bogus_key": 1}', '{"seed": "x"}',
                     '{"faults": 5}', '{"faults": [{"kind": "spike", "rate": 2}]}', '{"faults": [{"kind": "nope"}]}',
                     '{"gc": {"interval": "x"}}', '{"gc": {"interval": 0}}', '{"gc": false}', '{"window": 1.5}',
                     '{"window": -1}', '{"flush_every_s": 0}', '{"gain": "x"}', '{"gain": 5}', "/nonexistent.toml",
                     '{"memory": {"interval": -1}}', '{"affinity": 3}', '{"seed": 1e400}']),  # fmt: skip
    st.dictionaries(st.sampled_from(["seed", "faults", "gc", "window", "gain", "run_dir", "x"]),
                    st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none()),
                    max_size=3).map(lambda d: __import__("json").dumps(d)),  # fmt: skip
)
PATH_OPTIONS = {"--output", "--chrome", "--plot", "--write-run", "--run-dir", "--from-run", "--sysfs-root",
                "--log-dir", "--data", "--exclude-file", "--save", "--load"}  # fmt: skip
JSON_OPTIONS = {"--trace", "--chaos", "--stabilize", "--pace"}

# Values that are valid but would make one example take minutes are kept small (the bounds on
# them are checked by their own cases below): steps, node counts, ranks.
SMALL_INTS = st.one_of(st.sampled_from(["-1", "0", "1", "2", "3", "1e12", "10000001", "x", "", "nan"]),
                       st.integers(-3, 40).map(str))  # fmt: skip
SMALL_OPTIONS = {("simulate", "--steps"), ("simulate", "--gpus-per-node"), ("simulate", "--samples-per-rank")}
NODE_LISTS = st.sampled_from(["1", "2", "1,2", "0", "-1", "x", "", ",", "1,,2", "9" * 30, "1,9000",
                              ",".join(str(i) for i in range(1, 40)), "1," + "9" * 5000])  # fmt: skip
# Options given first so that a valid example stays quick; the fuzzed ones come after and win.
BASE = {
    "simulate": ["--steps", "30", "--nodes", "1", "--gpus-per-node", "2"],
    "theory": ["--sweep", "1,64"],
}


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and p.name not in ("help",)]


def _value(name: str, opt: click.Option) -> st.SearchStrategy[str]:
    flag = max(opt.opts, key=len)
    if isinstance(opt.type, click.Choice):
        return st.one_of(st.sampled_from(list(opt.type.choices)), VALUES)
    if flag in PATH_OPTIONS:
        return PATHS
    if flag in JSON_OPTIONS:
        return JSONISH
    if (name, flag) in SMALL_OPTIONS:
        return SMALL_INTS
    if flag in ("--nodes", "--sweep") and name in ("simulate", "theory"):
        return NODE_LISTS if name == "simulate" or flag == "--sweep" else SMALL_INTS
    return VALUES


def _args(name: str) -> st.SearchStrategy[list[str]]:
    command = LazyGroup().get_command(click.Context(cli), name)
    assert command is not None
    pairs = []
    for opt in _options(command):
        flag = max(opt.opts, key=len)
        if opt.is_flag:
            pairs.append(st.just([flag]))
        else:
            pairs.append(_value(name, opt).map(lambda v, f=flag: [f, v]))
    picked = st.lists(st.one_of(*pairs), min_size=1, max_size=3)
    return picked.map(lambda groups: [a for g in groups for a in g])


def _scratch(root: str) -> None:
    work = Path(root) / "w"
    work.mkdir()
    (work / "file").write_text("a regular file\n")
    os.mkfifo(work / "fifo")


def _invoke(args: list[str]) -> None:
    for flag, value in zip(args, args[1:], strict=False):  # never a path outside the scratch (and /proc)
        if flag in PATH_OPTIONS | {"-o"}:
            assert not value.startswith("/") or value.startswith(("/proc/", tempfile.gettempdir())), args
    with tempfile.TemporaryDirectory(prefix="hyperacc-fuzz-") as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            _scratch(scratch)
            result = CliRunner().invoke(cli, args)
        finally:
            os.chdir(cwd)
    check_cli_result(result)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    return str(small_run(tmp_path_factory.mktemp("fuzz") / "run"))


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text("print('never run: --dry-run')\n")
    return str(path)


def test_every_command_is_fuzzed():
    fuzzed = {"analyze", "report", "export", "theory", "simulate", "affinity", "run", "doctor", "watch", "compare"}
    # import-kineto reads profiler traces: its own suite fuzzes its input (tests/present)
    missing = set(COMMANDS) - fuzzed - {"import-kineto"}
    assert not missing, f"fuzz the options of {sorted(missing)} here (a test_<command>_options like the others)"


@FUZZ
@given(args=_args("analyze"))
def test_analyze_options(run_dir, args):
    _invoke(["analyze", run_dir, *args])


@FUZZ
@given(args=_args("compare"))
def test_compare_options(run_dir, args):
    _invoke(["compare", run_dir, run_dir, *args])


@FUZZ
@given(args=_args("report"))
def test_report_options(run_dir, args):
    if "--output" not in args and "-o" not in args:
        args = [*args, "--output", "w/report.html"]
    _invoke(["report", run_dir, *args])


@FUZZ
@given(args=_args("export"))
def test_export_options(run_dir, args):
    if "--chrome" not in args:
        args = [*args, "--chrome", "w/trace.json"]
    _invoke(["export", run_dir, "--no-diagnosis", *args])


@FUZZ
@given(args=_args("theory"))
def test_theory_options(args):
    _invoke(["theory", *BASE["theory"], *args])


@FUZZ
@given(args=_args("simulate"))
def test_simulate_options(args):
    _invoke(["simulate", *BASE["simulate"], *args])


@FUZZ
@given(args=_args("affinity"))
def test_affinity_options(args):
    _invoke(["affinity", "--json", *args])


@FUZZ
@given(args=_args("run"))
def test_run_options(script, args):
    if "--run-dir" not in args:
        args = ["--run-dir", "w/run", *args]
    _invoke(["run", "--dry-run", *args, "--", script])


@FUZZ
@given(args=_args("doctor"))
def test_doctor_options(args):
    _invoke(["doctor", "--dry-run", *args])


@FUZZ
@given(args=_args("watch"))
def test_watch_options(run_dir, args):
    _invoke(["watch", "--once", *args, run_dir])


# Inputs that failed before (a traceback, a hang, or silently wrong results), each once: every one now
# ends in one line, before anything starts.
KNOWN = [
    ["run", "--run-dir", "w/r", "--nproc-per-node", "0"], ["run", "--run-dir", "w/r", "--nproc-per-node", "-1"],
    ["run", "--run-dir", "w/r", "--nproc-per-node", "abc"], ["run", "--run-dir", "w/r", "--nproc-per-node", ""],
    ["run", "--run-dir", "w/r", "--stabilize", '{"gc": {"interval": "x"}}'], ["run", "--run-dir", "w/r", "--stabilize", "2"],
    ["run", "--run-dir", "w/r", "--chaos", '{"bogus_key": 1}'], ["run", "--run-dir", "w/r", "--torchrun-arg", "'unbalanced"],
    ["run", "--run-dir", "w/r", "--master-port", "99999"], ["run", "--run-dir", ""],
    ["run", "--run-dir", "w/r", "--stabilize", "/nonexistent.toml"],
    ["analyze", "RUN", "--top", "0"], ["analyze", "RUN", "--top", "-1"], ["analyze", "RUN", "--spike-floor-ms", "nan"],
    ["analyze", "RUN", "--spike-floor-ms", "inf"], ["analyze", "RUN", "--spike-floor-rel", "nan"],
    ["analyze", "RUN", "--z-threshold", "nan"], ["analyze", "RUN", "--iqr-k", "nan"], ["analyze", "RUN", "--ranks-per-node", "0"],
    ["export", "RUN", "--chrome", ""], ["simulate", "--steps", "1e12"], ["simulate", "--steps", "1000000000000"],
    ["simulate", "--plot", "w/nonexistent_dir/x.png"], ["simulate", "--write-run", "/proc/x"], ["simulate", "--seed", "-1"],
    ["affinity", "--nproc-per-node", "1000000"], ["theory", "--base-ms", "nan"], ["theory", "--spike-ms", "inf"],
    ["theory", "--node-mtbf-hours", "0"],
]  # fmt: skip
# Inputs that are valid (none at present): they must succeed.
NAMED: dict[str, None] = {}


@pytest.mark.parametrize("args", KNOWN, ids=[" ".join(a)[:60] for a in KNOWN])
def test_inputs_that_failed_before(run_dir, script, args):
    option = [a for a in args if a.startswith("--")][-1]  # the option under test comes last
    args = [run_dir if a == "RUN" else a for a in args]
    if args[0] == "run":
        args = [*args, "--dry-run", "--", script]
    with tempfile.TemporaryDirectory() as scratch:
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            _scratch(scratch)
            result = CliRunner().invoke(cli, args)
        finally:
            os.chdir(cwd)
    check_cli_result(result)
    key = " ".join(args[1:3]) if args[0] != "analyze" else " ".join(args[2:4])
    if key in NAMED:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2, result.output
    assert option in result.output, result.output


# ------------------------------------------------------------------ a sample as real processes

SAMPLE = [
    ["analyze", "RUN", "--spike-floor-rel", "nan"], ["analyze", "RUN", "--window-steps", "99999999999"],
    ["report", "RUN", "--step-bins", "99999999999", "-o", "w/r.html"], ["export", "RUN", "--chrome", "w/fifo"],
    ["simulate", "--steps", "1000000000000"], ["affinity", "--nproc-per-node", "1000000"],
    ["theory", "--sweep", ",".join(str(i) for i in range(1, 100))], ["run", "--run-dir", "", "--", "x.py"],
    ["analyze", "RUN", "--json"], ["theory", "--nodes", "64", "--json"],
]  # fmt: skip
MEMORY_LIMIT = 3 << 30  # bytes of address space per command: a dense per-step array would not fit


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.slow  # ten commands, each in its own interpreter
@pytest.mark.parametrize("args", SAMPLE, ids=[" ".join(a)[:50] for a in SAMPLE])
def test_sample_as_subprocesses(run_dir, tmp_path, args):
    """Real processes under a 3 GiB address-space limit and a generous time limit (a hang shows as
    a timeout, not as a slow run): the exit status and the one line are the process's own."""
    args = [run_dir if a == "RUN" else a for a in args]
    _scratch(str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "hyperacc", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240, preexec_fn=_limit_memory)  # fmt: skip
    assert proc.returncode in (0, 1, 2), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode != 0:
        assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1, proc.stderr
        assert proc.stdout.strip() == "", proc.stdout[-500:]
