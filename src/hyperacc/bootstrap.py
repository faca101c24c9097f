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

then runs the script as ``__main__`` with ``sys.argv`` set as if it had been started directly
(``-m module`` runs a module instead), and finally closes the stabilizers and flushes the tracer and
chaos ground truth. Parts that are not installed or not configured are skipped.

The script sees what ``python script.py`` would give it: the same absolute ``__file__``, the script's
directory as ``sys.path[0]`` (in place of the working directory that ``-m hyperacc.bootstrap`` put
there), ``sys.argv`` as given but for ``sys.argv[0]``, which is that absolute path too (``runpy`` sets
it to the path it runs; its base name, which ``argparse`` shows, is the same), and, when it fails,
the traceback Python would print for it alone, with exit status 1. The frames of this bootstrap and
``runpy`` before the script's first frame are left out, and so are the frames of hyperacc's wrappers
that the exception only passed through (the ``backward`` and ``forward`` wrappers of automatic
tracing); an exception raised inside hyperacc's own code keeps every frame of it
(docs/reliability.md, "What a failing script sees"). The same holds for the error file that torch's
``@record`` decorator writes for torchrun's summary (``_error_file_without_wrappers``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import runpy
import sys
import types
from typing import Any

log = logging.getLogger("hyperacc.bootstrap")

_OWN = os.path.dirname(os.path.abspath(__file__)) + os.sep  # frames of hyperacc's own code start with this

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
    return closers


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
    _error_file_without_wrappers()
    stopping = False
    failed: BaseException | None = None
    try:
        if module is not None:
            sys.argv = [module, *script_args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            # Python makes the script's path absolute by joining it to the working directory, unnormalised
            path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
            sys.argv = [path, *script_args]  # run_path sets argv[0] to the path it runs
            _script_dir_first(os.path.dirname(os.path.abspath(path)))
            runpy.run_path(path, run_name="__main__")
    except KeyboardInterrupt:
        stopping = True
        raise
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - printed below as Python prints an uncaught exception
        failed = exc
    finally:
        close(closers, stopping=stopping)
    if failed is not None:
        _exit_as_python_would(failed)


def _error_file_without_wrappers() -> None:
    """torchelastic's ``@record`` (torchtitan's ``main`` has it) writes the failing exception's traceback
    into the error file that torchrun's summary prints; it gets the frames the printed traceback leaves
    out left out too (the wrappers of automatic tracing that the exception passed through)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
    except ImportError:  # torch without distributed: there is no torchrun summary either
        return
    original = ErrorHandler.record_exception
    if getattr(original, "_hyperacc", False):
        return

    def record_exception(handler: Any, e: BaseException) -> None:
        try:
            _user_frames(e, head=False, seen=set())
        except Exception:  # noqa: BLE001 - the error file is written all the same, as it was
            pass
        original(handler, e)

    record_exception._hyperacc = True  # type: ignore[attr-defined]
    ErrorHandler.record_exception = record_exception  # type: ignore[method-assign]


def _script_dir_first(directory: str) -> None:
    """``sys.path[0]`` as ``python script.py`` sets it: the script's directory, not the working directory
    that ``python -m hyperacc.bootstrap`` put there (kept where hyperacc itself was imported from it)."""
    if getattr(sys.flags, "safe_path", False):
        return  # -P / PYTHONSAFEPATH: Python puts no directory of the script first either
    first = os.path.abspath(sys.path[0] or os.curdir) if sys.path else None
    hyperacc_from = os.path.dirname(_OWN.rstrip(os.sep))
    if first == os.getcwd() and first != hyperacc_from:
        sys.path[0] = directory
    else:
        sys.path.insert(0, directory)


def _exit_as_python_would(exc: BaseException) -> None:
    """Print ``exc`` through ``sys.excepthook`` with the traceback of the script alone, then exit 1."""
    _user_frames(exc, head=True, seen=set())
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = exc  # what Python 3.12 on sets for an uncaught exception, beside the three above
    sys.excepthook(type(exc), exc, exc.__traceback__)
    raise SystemExit(1)


def _own(entry: types.TracebackType) -> bool:
    return entry.tb_frame.f_code.co_filename.startswith(_OWN)


def _user_frames(exc: BaseException, *, head: bool, seen: set[int]) -> None:
    """Leave hyperacc's frames out of ``exc``'s traceback and of the exceptions chained to it: with
    ``head``, every frame before the first one outside hyperacc and ``runpy`` (the bootstrap running the
    script); elsewhere, hyperacc's frames that called code outside it (wrappers the exception passed
    through). The frames at the end that are hyperacc's (where the exception came from) stay."""
    seen.add(id(exc))
    entries = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    origin = len(entries)
    while origin > 0 and _own(entries[origin - 1]):
        origin -= 1
    if head:
        first = next((i for i, e in enumerate(entries) if not _own(e) and not _runpy(e)), origin)
        entries = entries[first:]
        origin -= first
    kept = [e for i, e in enumerate(entries) if i >= origin or not _own(e)]
    if len(kept) != len(entries) or head:
        rebuilt = None
        for e in reversed(kept):
            rebuilt = types.TracebackType(rebuilt, e.tb_frame, e.tb_lasti, e.tb_lineno)
        exc.__traceback__ = rebuilt
    for chained in (exc.__cause__, exc.__context__):
        if chained is not None and id(chained) not in seen:
            _user_frames(chained, head=False, seen=seen)


def _runpy(entry: types.TracebackType) -> bool:
    name = entry.tb_frame.f_code.co_filename
    return name == runpy.__file__ or name == "<frozen runpy>"


if __name__ == "__main__":
    main()
