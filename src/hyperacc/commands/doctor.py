"""``hyperacc doctor``: a pre-flight check of every rank, node and link before a job wastes a cluster.

    hyperacc doctor --nproc-per-node 8 --exclude-file hosts.exclude
    hyperacc doctor --nnodes 4 --node-rank $NODE --master-addr $HEAD --nproc-per-node 8 --data /datasets/x

starts one short process per rank through torchrun (the launch of ``hyperacc run``, same options),
measures compute, memory, dispatch, jitter, host-device copies, data reads, all-reduce and node-to-node
exchanges on every rank, judges each figure across ranks and nodes with the rules of ``hyperacc
analyze``, and prints verdict - evidence - next step (``--json``: the document). Hosts to leave out go
to ``--exclude-file``. Exit status: 0 healthy, 1 hosts to leave out, 2 bad input, the check could not run,
or the exclusion file could not be written (the findings are printed all the same).
Rules and defaults: docs/doctor.md.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from hyperacc.commands import run as _run
from hyperacc.commands.params import OneLineCommand, OutputFile
from hyperacc.preflight.options import DoctorOptions

_D = DoctorOptions()  # the defaults the help names, read from the options in force

# The launch options of `hyperacc run`, reused as they are (torchrun's own options).
_LAUNCH = {"nproc_per_node", "standalone", "extra", "chaos_json",
           *(name.replace("-", "_") for name in _run.TORCHRUN_VALUE_OPTIONS)}  # fmt: skip


def _fail(message: str) -> None:
    click.echo(f"hyperacc doctor: {message}", err=True)
    sys.exit(2)


@click.command(cls=OneLineCommand, context_settings={"ignore_unknown_options": False})
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="A file or directory whose read latency (p50/p99) is measured on every rank.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the doctor's document as JSON.")
@click.option("--exclude-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Add the hosts to leave out to this file (one name per line; created if missing).")  # fmt: skip
@click.option("--seconds", type=click.FloatRange(min=1.0, max=86_400.0), default=_D.seconds, show_default=True,
              help="Measurement time (start-up of the ranks comes on top).")  # fmt: skip
@click.option("--rounds", type=click.IntRange(min=1, max=1000), default=None, help=f"Rounds over which persistence is judged [{_D.rounds}].")
@click.option("--min-slowdown", type=click.FloatRange(min=0.0, max=100.0), default=None,
              help=f"A figure must be this much worse than the median to count [{_D.min_slowdown:g}].")  # fmt: skip
@click.option("--persist", type=click.IntRange(min=1, max=1000), default=None, help=f"... in at least this many rounds [{_D.persist_k}].")
@click.option("--timeout", type=click.FloatRange(min=1.0, max=10 * 86_400.0), default=None,
              help="Give up after this many seconds [10 x --seconds + 300].")  # fmt: skip
@click.option("--save", "save_path", type=OutputFile(), default=None,
              help="Also write the raw measurements of every rank here (JSON), to judge them again later.")  # fmt: skip
@click.option("--load", "load_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Judge measurements saved with --save (start no ranks); the rule options still apply.")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the torchrun command and the check's settings; start nothing.")
def command(
    data: Path | None,
    as_json: bool,
    exclude_file: Path | None,
    seconds: float,
    rounds: int | None,
    min_slowdown: float | None,
    persist: int | None,
    timeout: float | None,
    save_path: str | None,
    load_path: Path | None,
    dry_run: bool,
    nproc_per_node: str,
    standalone: bool | None,
    extra: tuple[str, ...],
    chaos_json: str | None,
    **torchrun: str | None,
) -> None:
    """Check every rank, node and link before training: verdict, evidence, hosts to leave out."""
    from hyperacc.preflight.judge import judge
    from hyperacc.preflight.options import ENV, ENV_OUT, DoctorConfigError

    if exclude_file is not None:  # before anything is measured: a finding must have somewhere to go
        from hyperacc.remediation.exclusion import writable_problem

        problem = writable_problem(exclude_file)
        if problem is not None:
            raise click.BadParameter(f"{problem}; give a file in a writable folder", param_hint="'--exclude-file'")
    settings: dict[str, Any] = {"seconds": seconds}
    if load_path is not None:
        try:
            raw = json.loads(load_path.read_text())
            settings = {**raw["options"], **{k: v for k, v in settings.items() if k != "seconds"}}
            raw["ranks"]  # noqa: B018 - the measurements must be there
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"{load_path} is not a file written by --save ({exc})",
                                     param_hint="--load") from None  # fmt: skip
        if rounds is not None:
            raise click.BadParameter("the rounds were fixed when the measurements were made", param_hint="--rounds")
    for key, value in (("rounds", rounds), ("min_slowdown", min_slowdown), ("persist_k", persist)):
        if value is not None:
            settings[key] = value
    if rounds is not None and persist is None:
        settings["persist_k"] = min(DoctorOptions.persist_k, rounds)
    if data is not None:
        if not data.exists():
            raise click.BadParameter(f"{data} does not exist; pass a file or directory of the data set",
                                     param_hint="--data")  # fmt: skip
        settings["data"] = str(data.resolve())
    try:
        opts = DoctorOptions.from_mapping(settings)
    except DoctorConfigError as exc:
        _fail(str(exc))
    if load_path is not None:
        _finish(judge(raw, opts), as_json, exclude_file)
    chaos_json = _run.json_option("--chaos", chaos_json)
    if chaos_json is not None:
        from hyperacc.chaos import ChaosConfigError, parse_config

        try:
            parse_config(chaos_json)
        except ChaosConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--chaos") from None

    options = {
        name: value
        for name in _run.TORCHRUN_VALUE_OPTIONS
        if (value := torchrun.get(name.replace("-", "_"))) is not None
    }
    if standalone is None:
        standalone = "nnodes" not in options and "rdzv-endpoint" not in options and "master-addr" not in options
    cmd = _run.build_command(
        ("-m", "hyperacc.preflight.worker"),
        nproc_per_node=nproc_per_node,
        standalone=standalone,
        torchrun_options=options,
        extra=extra,
    )
    if dry_run:
        click.echo(f"{ENV}={shlex.quote(opts.to_json())}")
        click.echo(shlex.join(cmd))
        return
    with tempfile.TemporaryDirectory(prefix="hyperacc-doctor-") as tmp:
        out = Path(tmp) / "measurements.json"
        env = dict(os.environ)
        env[ENV] = opts.to_json()
        env[ENV_OUT] = str(out)
        for key in ("HYPERACC_RUN_DIR", "HYPERACC_TRACE", "HYPERACC_STABILIZE", "HYPERACC_PACE", "HYPERACC_CHAOS"):
            env.pop(key, None)  # the check measures the bare host, not a traced or stabilized job
        if chaos_json is not None:
            env["HYPERACC_CHAOS"] = chaos_json
        if not as_json:
            click.echo(
                f"hyperacc doctor: measuring every rank for about {opts.seconds:.0f} s "
                f"({opts.rounds} rounds) ...",
                err=True,
            )
        code, output = _launch(cmd, env, timeout or 10 * opts.seconds + 300)
        if code != 0 or not out.exists():
            tail = "\n".join(output.strip().splitlines()[-25:])
            why = "timed out" if code is None else f"torchrun exited with status {code}"
            click.echo(f"hyperacc doctor: the check did not complete ({why}); last output:\n{tail}", err=True)
            sys.exit(2)
        raw = json.loads(out.read_text())
        if save_path is not None:
            try:
                Path(save_path).write_text(json.dumps(raw))
            except OSError as exc:
                _fail(f"cannot write --save {save_path}: {exc.strerror}")
    _finish(judge(raw, opts), as_json, exclude_file)


def _finish(doc: dict[str, Any], as_json: bool, exclude_file: Path | None) -> None:
    """Exclusion file, output, exit status (0 healthy, 1 hosts to leave out, 2 the exclusion file could
    not be written). The findings are printed even when the file cannot be written: they are the
    measurement's result, and the hosts are named there."""
    failed = None
    if exclude_file is not None:
        from hyperacc.remediation.exclusion import add_exclusions

        try:
            added = add_exclusions(exclude_file, doc["exclude_hosts"])
        except (OSError, ValueError) as exc:
            failed = f"cannot write --exclude-file {exclude_file}: {getattr(exc, 'strerror', None) or exc}"
            doc["exclude_file"] = {"path": str(exclude_file), "added": [], "error": failed}
        else:
            doc["exclude_file"] = {"path": str(exclude_file), "added": added}
    if as_json:
        click.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        _render(doc)
    if failed is not None:
        hosts = ", ".join(doc["exclude_hosts"]) or "none"
        _fail(f"{failed}; hosts to leave out: {hosts}")
    sys.exit(1 if doc["exclude_hosts"] else 0)


def _launch(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run torchrun in its own session; on timeout or Ctrl-C its whole process group goes."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if isinstance(exc, KeyboardInterrupt):
                raise
            code = None
        log.seek(0)
        return code, log.read().decode(errors="replace")


def _render(doc: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    nodes = doc["nodes"]
    from hyperacc.present.diagnosis import print_verdict

    title = (f"hyperacc doctor: {doc['world_size']} ranks, {nodes} node{'' if nodes == 1 else 's'}, "
             f"{doc['device']}, {doc['rounds']} rounds")  # fmt: skip
    print_verdict(con, title, doc["verdict"], bool(doc["findings"]), doc["evidence"], doc["next_step"])

    figures = doc["figures"]
    if figures:
        slow = {(f["rank"], fl["figure"]) for f in doc["findings"] if f["scope"] == "rank" for fl in f["figures"]}
        t = Table(title="Figures per rank (median over rounds; red: confirmed slow)", box=box.SIMPLE_HEAD)
        t.add_column("rank", justify="right")
        t.add_column("node", justify="right")
        t.add_column("host")
        names = list(figures)
        for name in names:
            t.add_column(f"{name}\n{figures[name]['unit']}", justify="right")
        ranks = figures[names[0]]["per_rank"]
        shown = ranks[:32]
        for i, row in enumerate(shown):
            cells = []
            for name in names:
                v = figures[name]["per_rank"][i]["value"]
                text = "-" if v is None else f"{v:.3g}"
                cells.append(f"[red]{text}[/red]" if (row["rank"], name) in slow else text)
            t.add_row(str(row["rank"]), str(row["node"]), row["host"], *cells)
        t.add_row("median", "", "", *[
            "-" if figures[n]["median"] is None else f"{figures[n]['median']:.3g}" for n in names
        ])  # fmt: skip
        if len(ranks) > len(shown):
            t.caption = f"{len(ranks) - len(shown)} more ranks; --json lists all"
        con.print(t)
    if doc["links"]:
        t = Table(title="Node pairs", box=box.SIMPLE_HEAD)
        for col in ("nodes", "hosts", "GB/s", "latency us", "vs best", "slow"):
            t.add_column(col, justify="left" if col in ("nodes", "hosts") else "right")
        for lk in doc["links"][:64]:
            t.add_row(
                f"{lk['nodes'][0]}-{lk['nodes'][1]}", " - ".join(lk["hosts"]),
                "-" if lk["bandwidth_gbps"] is None else f"{lk['bandwidth_gbps']:.3g}",
                "-" if lk["latency_us"] is None else f"{lk['latency_us']:.3g}",
                "-" if lk["ratio_to_best"] is None else f"{lk['ratio_to_best']:.2f}x",
                "[red]yes[/red]" if lk["slow"] else "no",
            )  # fmt: skip
        con.print(t)
    if doc.get("exclude_file"):
        ex = doc["exclude_file"]
        if ex.get("error"):
            con.print(f"[red]Exclusion file {ex['path']}: not written[/red] ({ex['error']}).")
        else:
            added = ", ".join(ex["added"]) if ex["added"] else "nothing new"
            con.print(f"Exclusion file {ex['path']}: added {added}.")


# The launch options come from `hyperacc run`, so both commands take the same torchrun options.
command.params[:0] = [p for p in _run.command.params if p.name in _LAUNCH]
