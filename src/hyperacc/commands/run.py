"""``hyperacc run``: start an unmodified training script through torchrun with hyper-trace on.

    hyperacc run --run-dir runs/exp1 --nproc-per-node 4 -- train.py --epochs 3

becomes ``python -m torch.distributed.run --nproc-per-node 4 -m hyperacc.bootstrap train.py --epochs 3``
with ``HYPERACC_RUN_DIR`` (and ``HYPERACC_TRACE`` / ``HYPERACC_CHAOS`` / ``HYPERACC_STABILIZE`` when
given) in the environment; the process is replaced by torchrun (``exec``), so signals and the exit
status are torchrun's own.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

# torchrun options offered directly (name, takes a value); anything else: --torchrun-arg.
_TORCHRUN_VALUE_OPTIONS = (
    "nnodes", "node-rank", "master-addr", "master-port", "rdzv-backend", "rdzv-endpoint", "rdzv-id",
    "rdzv-conf", "max-restarts", "monitor-interval", "log-dir", "redirects", "tee", "local-addr",
)  # fmt: skip


def _json_option(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if name != "--stabilize" or text.startswith(("{", "[")):
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON ({exc})", param_hint=name) from None
        if not isinstance(parsed, dict):
            raise click.BadParameter("must be a JSON object", param_hint=name)
    return text


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
    cmd += ["-m", "hyperacc.bootstrap", *script_and_args]
    return cmd


@click.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": False})
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the step records (created if missing).",
)
@click.option(
    "--nproc-per-node",
    default="1",
    show_default=True,
    help="Ranks per node (a number, or torchrun's gpu/cpu/auto).",
)
@click.option(
    "--standalone/--no-standalone",
    default=None,
    help="Single-node rendezvous (default when --nnodes and --rdzv-endpoint are not given).",
)
@click.option("--nnodes", default=None, help="Number of nodes, or MIN:MAX (torchrun).")
@click.option("--node-rank", default=None, help="This node's rank (torchrun, static rendezvous).")
@click.option("--master-addr", default=None, help="torchrun --master-addr.")
@click.option("--master-port", default=None, help="torchrun --master-port.")
@click.option("--rdzv-backend", default=None, help="torchrun --rdzv-backend.")
@click.option("--rdzv-endpoint", default=None, help="torchrun --rdzv-endpoint.")
@click.option("--rdzv-id", default=None, help="torchrun --rdzv-id.")
@click.option("--rdzv-conf", default=None, help="torchrun --rdzv-conf.")
@click.option("--max-restarts", default=None, help="torchrun --max-restarts.")
@click.option("--monitor-interval", default=None, help="torchrun --monitor-interval.")
@click.option("--log-dir", default=None, help="torchrun --log-dir.")
@click.option("--redirects", default=None, help="torchrun --redirects.")
@click.option("--tee", default=None, help="torchrun --tee.")
@click.option("--local-addr", default=None, help="torchrun --local-addr.")
@click.option(
    "--torchrun-arg",
    "extra",
    multiple=True,
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
    dry_run: bool,
    script_and_args: tuple[str, ...],
    **torchrun: str | None,
) -> None:
    """Run SCRIPT [ARGS] in every rank through torchrun, traced (no change to the script needed).

    Put the script after `--`: hyperacc run --run-dir runs/x --nproc-per-node 4 -- train.py --lr 0.1
    """
    trace_json = _json_option("--trace", trace_json)
    chaos_json = _json_option("--chaos", chaos_json)
    stabilize_json = _json_option("--stabilize", stabilize_json)
    if pace_json is not None:
        from hyperacc.pacing.controller import PacingConfigError
        from hyperacc.pacing.runtime import config_from_json

        try:
            config_from_json(pace_json)
        except PacingConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--pace") from None
    if trace_json is not None:
        from hyperacc.trace.options import TraceConfigError, TraceOptions

        try:
            TraceOptions.from_json(trace_json)
        except TraceConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--trace") from None
    script = script_and_args[0]
    if script == "-m":
        if len(script_and_args) < 2:
            raise click.UsageError("-m needs a module name: hyperacc run ... -- -m package.module [ARGS]")
    elif not Path(script).is_file():
        raise click.BadParameter(f"training script {script!r} not found", param_hint="SCRIPT")

    options = {
        name: value
        for name in _TORCHRUN_VALUE_OPTIONS
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
    if stabilize_json is not None:
        # allocator settings before CUDA initialises and tcmalloc's background release off
        from hyperacc import stabilize

        try:
            cfg = stabilize.load_config(stabilize_json) if Path(stabilize_json).is_file() else (
                None if stabilize_json.strip() in ("1", "true") else json.loads(stabilize_json))
            extra_env = stabilize.launch_env(cfg)
        except (ValueError, OSError) as exc:
            raise click.BadParameter(str(exc), param_hint="--stabilize") from None
        extra_env.pop(stabilize.ENV_VAR, None)  # the ranks parse the user's own text
        env.update(extra_env)
    if dry_run:
        ours = ["HYPERACC_RUN_DIR", "HYPERACC_TRACE", "HYPERACC_CHAOS", "HYPERACC_STABILIZE", "HYPERACC_PACE"]
        added = sorted(k for k in env if env.get(k) != os.environ.get(k) and k not in ours)
        for key in [k for k in ours if k in env] + added:
            if key in env:
                click.echo(f"{key}={shlex.quote(env[key])}")
        click.echo(shlex.join(cmd))
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create {run_dir}: {exc.strerror}", param_hint="--run-dir") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
