"""``hyperacc run``: start an unmodified training script through torchrun with hyper-trace on.

    hyperacc run --run-dir runs/exp1 --nproc-per-node 4 -- train.py --epochs 3

becomes ``python -m torch.distributed.run --nproc-per-node 4 --no-python python -u -mhyperacc.bootstrap
train.py --epochs 3``
with ``HYPERACC_RUN_DIR`` (and ``HYPERACC_TRACE`` / ``HYPERACC_CHAOS`` / ``HYPERACC_STABILIZE`` when
given) in the environment. torchrun runs as this process's child (``hyperacc.supervisor``), which
passes every signal on once and ends with torchrun's exit status; meanwhile this process is the node
agent: the live view, and the compaction of its ranks' records (``hyperacc.agent``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import click

from hyperacc.agent import Compactor, LiveNode, MetricsEndpoint, NodeAgent
from hyperacc.commands.params import OneLineCommand, OutputDir
from hyperacc.remediation.config import ENV as REMEDIATE_ENV
from hyperacc.supervisor import Supervisor, choose_view
from hyperacc.trace.options import ENV_NODE_AGENT

# torchrun options offered directly (name, takes a value); anything else: --torchrun-arg.
TORCHRUN_VALUE_OPTIONS = (
    "nnodes", "node-rank", "master-addr", "master-port", "rdzv-backend", "rdzv-endpoint", "rdzv-id",
    "rdzv-conf", "max-restarts", "monitor-interval", "log-dir", "redirects", "tee", "local-addr",
)  # fmt: skip


def json_option(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if name != "--stabilize" or text.startswith(("{", "[")):
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON ({exc})", param_hint=f"'{name}'") from None
        if not isinstance(parsed, dict):
            raise click.BadParameter("must be a JSON object", param_hint=f"'{name}'")
    return text


MAX_LOCAL_RANKS = 4096  # ranks one torchrun agent starts (as hyperacc affinity)


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number when it is one of at most 9 digits (larger ones are no count here)."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


def _nproc(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """torchrun's --nproc-per-node: a positive whole number, or gpu, cpu, auto."""
    text = value.strip()
    if text in ("gpu", "cpu", "auto"):
        return text
    n = _whole_number(text)
    if n is None or not 1 <= n <= MAX_LOCAL_RANKS:
        raise click.BadParameter(f"{value[:40]!r}: give a whole number from 1 to {MAX_LOCAL_RANKS}, or gpu, cpu, auto")
    return str(n)


def _whole(low: int, high: int | None = None):
    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        n = _whole_number(value)
        if n is None or n < low or (high is not None and n > high):
            upper = f" to {high}" if high is not None else " or more"
            raise click.BadParameter(f"{value[:40]!r}: give a whole number from {low}{upper}")
        return str(n)

    return check


def _nnodes(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """torchrun's --nnodes: N or MIN:MAX, whole numbers >= 1."""
    if value is None:
        return None
    parts = [_whole_number(p) for p in value.split(":")]
    if len(parts) > 2 or not all(p is not None and p >= 1 for p in parts) or parts[0] > parts[-1]:
        raise click.BadParameter(f"{value[:40]!r}: give a number of nodes N or a range MIN:MAX (1 <= MIN <= MAX)")
    return ":".join(str(p) for p in parts)


def _interval(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e9:  # NaN fails too
        raise click.BadParameter(f"{value[:40]!r}: give a number of seconds > 0")
    return value.strip()


_STD = re.compile(r"^\s*(?:[0-3]|[0-9]{1,6}:[0-3](?:\s*,\s*[0-9]{1,6}:[0-3])*)\s*$")


def _std(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """torchrun's --redirects / --tee: 0-3, or per local rank as 0:1,1:2."""
    if value is not None and not _STD.match(value):
        raise click.BadParameter(f"{value[:40]!r}: give 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per rank as 0:3,1:1")
    return value


def _torchrun_args(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    for item in values:
        try:
            shlex.split(item)
        except ValueError as exc:
            raise click.BadParameter(f"{item!r}: {exc}; quote it as a shell would") from None
    return values


def _config_error(exc: Exception, option: str, page: str) -> click.BadParameter:
    """A configuration's error as one line naming ``option``; a wrong type says so."""
    text = str(exc) if isinstance(exc, ValueError) else f"a setting has the wrong type ({exc})"
    return click.BadParameter(f"{text}; see {page}", param_hint=f"'{option}'")


def _stabilize_env(text: str) -> dict[str, str] | None:
    """Parse ``--stabilize`` as every rank will (``hyperacc.stabilize.from_env``) and return the
    environment it adds; None when it switches the stabilizers off."""
    from hyperacc import stabilize

    raw = text.strip()
    word = raw.lower()
    if word in ("", "0", "false", "off", "no"):
        return None
    try:
        if word in ("1", "true", "on", "yes"):
            return stabilize.launch_env()
        if raw.startswith("{"):
            return stabilize.launch_env(stabilize.config_from_dict(json.loads(raw), "--stabilize"))
        if Path(raw).is_file():
            return stabilize.launch_env(raw)
    except (ValueError, TypeError, OSError, AttributeError) as exc:
        raise _config_error(exc, "--stabilize", "docs/stabilizers.md") from None
    raise click.BadParameter(
        f"{raw!r} is neither JSON, 1/0, nor an existing config file", param_hint="'--stabilize'"
    )


def _remediate(text: str, torchrun: dict[str, str | None]):  # -> remediation.config.LaunchSettings
    """``--remediate`` checked as the ranks will read it; raises torchrun's --max-restarts for drains."""
    from hyperacc.remediation.config import RemediationConfigError, launch_settings

    try:
        settings = launch_settings(text, nnodes=torchrun.get("nnodes"), max_restarts=torchrun.get("max_restarts"))
    except RemediationConfigError as exc:
        raise _config_error(exc, "--remediate", "docs/remediation.md") from None
    if settings.max_restarts is not None:
        torchrun["max_restarts"] = settings.max_restarts
    return settings


def build_command(
    script_and_args: tuple[str, ...],
    *,
    nproc_per_node: str,
    standalone: bool,
    torchrun_options: dict[str, str],
    extra: tuple[str, ...],
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc_per_node]
    if standalone:
        cmd.append("--standalone")
    for name, value in torchrun_options.items():
        cmd += [f"--{name}", value]
    for item in extra:
        cmd += shlex.split(item)
    # torchrun starts ``python -u -mhyperacc.bootstrap SCRIPT ...`` (``--no-python``, the interpreter
    # torchrun itself would use, ``-u`` as it adds it): torchrun then names the script, not the bootstrap,
    # in its summary of a failed job (it names the first argument that is not an option).
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    cmd += ["--no-python", python, "-u", "-mhyperacc.bootstrap", *script_and_args]
    return cmd


@click.command(
    cls=OneLineCommand, context_settings={"allow_interspersed_args": False, "ignore_unknown_options": False}
)
@click.option(
    "--run-dir",
    required=True,
    type=OutputDir(),
    help="Directory for the step records (created if missing).",
)
@click.option(
    "--nproc-per-node",
    default="1",
    show_default=True,
    callback=_nproc,
    help="Ranks per node (a number, or torchrun's gpu/cpu/auto).",
)
@click.option(
    "--standalone/--no-standalone",
    default=None,
    help="Single-node rendezvous (default when --nnodes and --rdzv-endpoint are not given).",
)
@click.option("--nnodes", default=None, callback=_nnodes, help="Number of nodes, or MIN:MAX (torchrun).")
@click.option("--node-rank", default=None, callback=_whole(0), help="This node's rank (torchrun, static rendezvous).")
@click.option("--master-addr", default=None, help="torchrun --master-addr.")
@click.option("--master-port", default=None, callback=_whole(1, 65535), help="torchrun --master-port (1-65535).")
@click.option("--rdzv-backend", default=None, help="torchrun --rdzv-backend.")
@click.option("--rdzv-endpoint", default=None, help="torchrun --rdzv-endpoint.")
@click.option("--rdzv-id", default=None, help="torchrun --rdzv-id.")
@click.option("--rdzv-conf", default=None, help="torchrun --rdzv-conf.")
@click.option("--max-restarts", default=None, callback=_whole(0), help="torchrun --max-restarts.")
@click.option("--monitor-interval", default=None, callback=_interval, help="torchrun --monitor-interval.")
@click.option("--log-dir", default=None, help="torchrun --log-dir.")
@click.option("--redirects", default=None, callback=_std, help="torchrun --redirects.")
@click.option("--tee", default=None, callback=_std, help="torchrun --tee.")
@click.option("--local-addr", default=None, help="torchrun --local-addr.")
@click.option(
    "--torchrun-arg",
    "extra",
    multiple=True,
    callback=_torchrun_args,
    help="Any other torchrun option, passed as written (repeatable), e.g. '--numa-binding node'.",
)
@click.option(
    "--trace",
    "trace_json",
    default=None,
    help='Tracer options as JSON (docs/tracing.md), e.g. \'{"window": 100, "probe_every": 50}\'.',
)
@click.option("--chaos", "chaos_json", default=None, help="Fault injection as JSON (hyperacc.chaos).")
@click.option(
    "--stabilize",
    "stabilize_json",
    default=None,
    help="Stabilizers: JSON, 1 for the defaults, or a config file (hyperacc.stabilize).",
)
@click.option(
    "--pace",
    "pace_json",
    default=None,
    help="Pacing at the gradient collective: 1 for the defaults or JSON settings (docs/pacing.md).",
)
@click.option(
    "--remediate",
    "remediate_text",
    default=None,
    help="Act on confirmed verdicts: off, dry-run, auto, or a JSON policy / JSON file (docs/remediation.md).",
)
@click.option("--overwrite", is_flag=True,
              help="--run-dir holds another run's records: remove them first (otherwise the run is refused).")  # fmt: skip
@click.option("--quiet", is_flag=True, help="No live view; the job's output untouched.")
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve the Prometheus metrics of this node's ranks on this port, from hyperacc run itself "
                   "(docs/presentation.md).")  # fmt: skip
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address the metrics endpoint listens on (0.0.0.0: every interface).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and environment; start nothing.")
@click.argument("script_and_args", nargs=-1, type=click.UNPROCESSED, required=True)
def command(
    run_dir: Path,
    nproc_per_node: str,
    standalone: bool | None,
    extra: tuple[str, ...],
    trace_json: str | None,
    chaos_json: str | None,
    stabilize_json: str | None,
    pace_json: str | None,
    remediate_text: str | None,
    overwrite: bool,
    quiet: bool,
    metrics_port: int | None,
    metrics_host: str,
    dry_run: bool,
    script_and_args: tuple[str, ...],
    **torchrun: str | None,
) -> None:
    """Run SCRIPT [ARGS] in every rank through torchrun, traced (no change to the script needed).

    Put the script after `--`: hyperacc run --run-dir runs/x --nproc-per-node 4 -- train.py --lr 0.1
    """
    trace_json = json_option("--trace", trace_json)
    chaos_json = json_option("--chaos", chaos_json)
    stabilize_json = json_option("--stabilize", stabilize_json)
    # Every configuration is parsed here exactly as the ranks will parse it, so a mistake ends the
    # launcher with one line before torchrun starts, not every rank with a traceback.
    if pace_json is not None and pace_json.strip() != "0":
        from hyperacc.pacing.runtime import config_from_json

        try:
            config_from_json(pace_json)
        except (ValueError, TypeError) as exc:
            raise _config_error(exc, "--pace", "docs/pacing.md") from None
    if trace_json is not None:
        from hyperacc.trace.options import TraceOptions

        try:
            TraceOptions.from_json(trace_json)
        except (ValueError, TypeError) as exc:
            raise _config_error(exc, "--trace", "docs/tracing.md") from None
    if chaos_json is not None:
        from hyperacc.chaos import parse_config

        try:
            parse_config(chaos_json)
        except (ValueError, TypeError, AttributeError) as exc:
            raise _config_error(exc, "--chaos", "the hyperacc.chaos module") from None
    stabilize_env = _stabilize_env(stabilize_json) if stabilize_json is not None else None
    script = script_and_args[0]
    if script == "-m":
        if len(script_and_args) < 2:
            raise click.UsageError("-m needs a module name: hyperacc run ... -- -m package.module [ARGS]")
    elif not Path(script).is_file():
        raise click.BadParameter(f"training script {script!r} not found", param_hint="SCRIPT")

    remediate = _remediate(remediate_text, torchrun) if remediate_text is not None else None
    options = {
        name: value
        for name in TORCHRUN_VALUE_OPTIONS
        if (value := torchrun.get(name.replace("-", "_"))) is not None
    }
    if standalone is None:
        standalone = (
            "nnodes" not in options and "rdzv-endpoint" not in options and "master-addr" not in options
        )
    cmd = build_command(
        script_and_args,
        nproc_per_node=nproc_per_node,
        standalone=standalone,
        torchrun_options=options,
        extra=extra,
    )
    env = dict(os.environ)
    run_dir = run_dir.resolve()
    env["HYPERACC_RUN_DIR"] = str(run_dir)
    for key, value in (
        ("HYPERACC_TRACE", trace_json),
        ("HYPERACC_CHAOS", chaos_json),
        ("HYPERACC_STABILIZE", stabilize_json),
        ("HYPERACC_PACE", pace_json),
    ):
        if value is not None:
            env[key] = value
    if stabilize_env is not None:
        # allocator settings before CUDA initialises and tcmalloc's background release off
        stabilize_env.pop("HYPERACC_STABILIZE", None)  # the ranks parse the user's own text
        env.update(stabilize_env)
    if remediate is not None:
        env.update(remediate.env)
    rdzv_id = None if standalone else options.get("rdzv-id")
    _check_reuse(run_dir, rdzv_id, overwrite, dry_run)
    if dry_run:
        for note in remediate.notes if remediate is not None else ():
            click.echo(f"# --remediate: {note}")
        if metrics_port is not None:
            click.echo(f"# --metrics-port: this node's agent serves its ranks' /metrics on {metrics_host}:{metrics_port}")
        ours = ["HYPERACC_RUN_DIR", "HYPERACC_TRACE", "HYPERACC_CHAOS", "HYPERACC_STABILIZE", "HYPERACC_PACE"]
        added = sorted(k for k in env if env.get(k) != os.environ.get(k) and k not in ours)
        for key in [k for k in ours if k in env] + added:
            if key in env:
                click.echo(f"{key}={shlex.quote(env[key])}")
        click.echo(shlex.join(cmd))
        return
    try:
        if overwrite:
            _remove_records(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / JOB_FILE).write_text(json.dumps({"rdzv_id": rdzv_id, "host": platform.node(),
                                                    "started_unix": time.time()}) + "\n")  # fmt: skip
    except OSError as exc:
        raise click.BadParameter(f"cannot write in {run_dir}: {exc.strerror}", param_hint="'--run-dir'") from None
    sys.stdout.flush()
    sys.stderr.flush()
    view = choose_view(quiet)
    agent = f"{platform.node()}:{os.getpid()}"  # this process rolls its ranks' records into Parquet
    env[ENV_NODE_AGENT] = agent
    if view == "panel":
        env.setdefault("PYTHONUNBUFFERED", "1")  # the ranks' output reaches the terminal as it is written
    window = _live_window(trace_json)
    live = LiveNode.from_trace_json(run_dir, trace_json, agent=agent, remediate=env.get(REMEDIATE_ENV))
    metrics = None
    if metrics_port is not None:
        metrics = MetricsEndpoint(run_dir, agent=agent, address=f"{metrics_host}:{metrics_port}",
                                  stragglers=live.confirmed_stragglers, job_slowdown=live.job_slowdown)  # fmt: skip
    node = NodeAgent(live, Compactor.from_trace_json(run_dir, trace_json, agent=agent), metrics)
    sys.exit(Supervisor(cmd, env, run_dir, view=view, window=window, agent=node).run())


# Reusing a run directory (docs/reliability.md, "Run directories"): a second job's rows would be mixed
# with the first's (steps 0-19 twice). `hyperacc run` refuses a directory that holds another job's
# records; restarts inside one torchrun (elastic restarts, --max-restarts, a drain) never come back
# here, and the nodes of one multi-node job are one job when they share --rdzv-id.
JOB_FILE = "job.json"  # written by the launcher: the rendezvous id of the job that owns the directory
RECORDS = ("steps", "meta", "events", "resources", "live", "chaos", "remediation")  # what ranks write


def _has_records(run_dir: Path) -> bool:
    for name in RECORDS:
        folder = run_dir / name
        try:
            if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
                return True
        except OSError:
            return True
    return False


def _check_reuse(run_dir: Path, rdzv_id: str | None, overwrite: bool, dry_run: bool) -> None:
    """Refuse a run directory that holds another job's records, unless ``--overwrite``."""
    if overwrite or not run_dir.is_dir() or not _has_records(run_dir):
        return
    try:
        owner = json.loads((run_dir / JOB_FILE).read_text()).get("rdzv_id")
    except (OSError, ValueError, AttributeError):
        owner = None
    if rdzv_id and rdzv_id != "none" and owner == rdzv_id:
        return  # another node of the same job (same --rdzv-id), or the same job started again
    raise click.BadParameter(
        f"{run_dir} already holds the records of another run; give a new directory, or pass --overwrite "
        "to remove them first (the nodes of one multi-node job share a directory when they share --rdzv-id)",
        param_hint="'--run-dir'",
    )


def _remove_records(run_dir: Path) -> None:
    """What ranks write in ``run_dir``, removed; anything else there (an exclusion file, a checkpoint, a
    report) is kept."""
    import shutil

    for name in RECORDS:
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
    (run_dir / JOB_FILE).unlink(missing_ok=True)


def _live_window(trace_json: str | None) -> int:
    """The steps one line of the view covers: the tracer's window (50 by default)."""
    from hyperacc.trace.options import TraceOptions

    window = TraceOptions.from_json(trace_json).window if trace_json is not None else TraceOptions().window
    return window if window >= 2 else 50
