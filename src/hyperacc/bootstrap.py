"""Run an unmodified training script with hyperacc around it: ``python -m hyperacc.bootstrap script.py [args]``.

This is what ``hyperacc run`` starts in every rank (through torchrun). From the environment it
installs, in this order:

1. fault injection, ``hyperacc.chaos.install_from_env()`` (``HYPERACC_CHAOS``), first, so that the
   tracer's hooks wrap the injected stalls and measure them like real ones;
2. automatic tracing, ``hyperacc.trace.install_auto()`` (``HYPERACC_RUN_DIR``, ``HYPERACC_TRACE``);
3. stabilizers, ``hyperacc.stabilize.from_env()`` (``HYPERACC_STABILIZE``), whose ``step(step)`` is
   then called at every step boundary the tracer sees (an unmodified script does not call it); the
   variable is then removed from the environment so that a script which starts stabilizers itself
   does not start a second set;
4. live remediation, ``hyperacc.remediation.live.install`` (``HYPERACC_REMEDIATE`` other than ``off``):
   rank 0 decides after each live window, every rank applies live switches at the agreed step
   (docs/remediation.md);

5. on rank 0, the Prometheus endpoint of ``hyperacc run --metrics-port`` (``HYPERACC_METRICS``);

then runs the script as ``__main__`` with ``sys.argv`` set as if it had been started directly
(``-m module`` runs a module instead), and finally closes the stabilizers and flushes the tracer and
chaos ground truth. Parts that are not installed or not configured are skipped.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import runpy
import sys
from typing import Any

log = logging.getLogger("hyperacc.bootstrap")

USAGE = "usage: python -m hyperacc.bootstrap SCRIPT.py [ARGS...]  |  -m MODULE [ARGS...]"


class BootstrapError(SystemExit):
    pass


def _optional(module: str, function: str) -> Any:
    """``module.function()`` if that module exists; its configuration errors are the user's to see."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return None
        raise
    return getattr(mod, function)()


def install() -> list[Any]:
    """Install chaos, tracing and stabilizers from the environment; returns what must be closed."""
    from hyperacc.options import OptionsError, env_text
    from hyperacc.trace import ENV_RUN_DIR, install_auto
    from hyperacc.trace.options import ENV_NODE_AGENT

    closers: list[Any] = []
    if env_text("HYPERACC_CHAOS"):
        chaos = _optional("hyperacc.chaos", "install_from_env")
        if chaos is not None:
            closers.append(chaos)
    pace = env_text("HYPERACC_PACE")
    pacing = bool(pace) and pace != "0"
    if env_text(ENV_RUN_DIR):
        if not env_text(ENV_NODE_AGENT):  # under hyperacc run, its node agent makes the live windows
            from hyperacc.analysis import live_aggregate

            live_aggregate.install()  # rank 0 gathers every rank's window summaries (trace/ does not import it)
        try:
            # pacing reads every rank's arrival from the in-band exchange: it asks for it
            closers.append(install_auto(**({"inband": True} if pacing else {})))
        except OptionsError as exc:
            raise BootstrapError(f"hyperacc: {exc}") from None
    else:
        log.warning("hyperacc: %s is not set; the script runs without tracing", ENV_RUN_DIR)
    if pacing:
        auto = next((c for c in closers if hasattr(c, "tracer")), None)
        if auto is None:
            log.warning("hyperacc: pacing needs the tracer's in-band exchange (set %s); pacing is off", ENV_RUN_DIR)
        else:
            from hyperacc.pacing.runtime import PacingHook, config_from_json

            try:
                PacingHook(config_from_json(pace)).attach(auto.tracer.inband)
            except OptionsError as exc:
                raise BootstrapError(f"hyperacc: {exc}") from None
    if env_text("HYPERACC_STABILIZE"):
        stabilizer = _optional("hyperacc.stabilize", "from_env")
        # Consumed here: a script that also starts stabilizers from the environment (as
        # examples/train_ddp.py does) must not start a second set.
        os.environ.pop("HYPERACC_STABILIZE", None)
        if stabilizer is not None:
            closers.insert(0, stabilizer)
            auto = closers[-1] if closers and hasattr(closers[-1], "add_step_callback") else None
            if auto is not None and hasattr(stabilizer, "step"):
                auto.add_step_callback(stabilizer.step)  # the script does not call step(): the tracer does
    remediate = env_text("HYPERACC_REMEDIATE")
    if remediate and remediate != "off":  # off: nothing is installed, nothing runs in the step
        from hyperacc.remediation.live import install as install_remediation

        auto = next((c for c in closers if hasattr(c, "add_step_callback")), None)
        live = install_remediation(auto) if auto is not None else None
        if auto is None:
            log.warning("hyperacc: remediation needs the tracer (set %s); remediation is off", ENV_RUN_DIR)
        if live is not None:
            closers.insert(0, live)  # closed first: its stabilizers end before the tracer flushes
    metrics = _metrics_endpoint()
    if metrics is not None:
        closers.append(metrics)
    return closers


def _metrics_endpoint() -> Any:
    """Rank 0 serves every rank's Prometheus metrics when ``hyperacc run --metrics-port`` asked for it."""
    from hyperacc import process
    from hyperacc.options import env_text
    from hyperacc.supervisor import METRICS_ENV
    from hyperacc.trace import ENV_RUN_DIR

    address, run_dir, here = env_text(METRICS_ENV), env_text(ENV_RUN_DIR), process.place()
    if not address or not run_dir or here.rank != 0:
        return None
    try:
        from hyperacc.present.metrics import RunDirEndpoint

        return RunDirEndpoint(run_dir, address, world_size=here.world_size)
    except Exception as exc:  # noqa: BLE001 - the endpoint is a convenience; training goes on
        log.warning("hyperacc: metrics endpoint %s not served: %r", address, exc)
        return None


def close(closers: list[Any], *, stopping: bool = False) -> None:
    """Close what ``install`` started; ``stopping``: the script was interrupted, do not wait for peers."""
    for obj in closers:
        fn = getattr(obj, "close", None)
        if fn is None:
            continue
        try:
            if stopping and "stopping" in inspect.signature(fn).parameters:
                fn(stopping=True)
            else:
                fn()
        except Exception as exc:  # noqa: BLE001 - the script's own result must not be lost
            print(f"hyperacc: closing {type(obj).__name__} failed: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        raise BootstrapError(USAGE)
    module = None
    if args[0] == "-m":
        if len(args) < 2:
            raise BootstrapError(USAGE)
        module, script_args = args[1], args[2:]
    else:
        script, script_args = args[0], args[1:]
        if not os.path.isfile(script):
            raise BootstrapError(
                f"hyperacc: training script {script!r} not found; pass the path of a .py file"
            )
    closers = install()
    stopping = False
    try:
        if module is not None:
            sys.argv = [module, *script_args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *script_args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:
        stopping = True
        raise
    finally:
        close(closers, stopping=stopping)


if __name__ == "__main__":
    main()
