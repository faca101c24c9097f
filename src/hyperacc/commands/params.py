"""Option types shared by the commands: every value is checked where it enters, before anything starts.

A value that does not fit ends the command with one line that names the option and what is allowed
(``click.BadParameter``, exit status 2; docs/reliability.md, "Command-line input"). Rules that belong
to a configuration (``DetectionOptions``, ``TraceOptions``, ...) stay in its dataclass; ``option_error``
turns the dataclass' ``ValueError`` into that one line, naming the option the user typed.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click


class OneLineUsageError(click.UsageError):
    """A usage error shown as one line (no usage block): what was wrong, and where the help is."""

    def show(self, file: Any = None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file if file is not None else sys.stderr)


def one_line(exc: click.UsageError) -> OneLineUsageError:
    if isinstance(exc, OneLineUsageError):
        return exc
    message = exc.format_message()
    if exc.ctx is not None:
        message += f" (see '{exc.ctx.command_path} --help')"
    return OneLineUsageError(message)


class OneLineErrors:
    """Mixin for click commands and groups: every usage error is one line, exit status 2."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:  # fmt: skip
        try:
            return super().make_context(info_name, args, parent=parent, **extra)  # type: ignore[misc]
        except click.UsageError as exc:
            raise one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)  # type: ignore[misc]
        except click.UsageError as exc:
            raise one_line(exc) from None


class OneLineCommand(OneLineErrors, click.Command):
    """A command whose usage errors are one line, exit status 2, also when it is invoked on its own
    (``hyperacc.cli`` does the same for every subcommand)."""


class Number(click.FloatRange):
    """A finite number (NaN and infinities are refused), optionally within a range."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("expected a number, got an empty value", param, ctx)
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        # click's help shows the range beside the option; without bounds it would read "x<=None"
        return super()._describe_range() if self.min is not None or self.max is not None else ""


FINITE = Number()


def _creatable(directory: Path) -> str | None:
    """Why nothing can be created at ``directory`` (the folder itself or, when missing, in its nearest
    existing ancestor), or None when it can. Probed with a temporary folder, removed at once."""
    here = directory
    try:
        while not here.exists() and here.parent != here:
            here = here.parent
        if not here.is_dir():
            return f"{here} is not a directory"
        os.rmdir(tempfile.mkdtemp(dir=here, prefix=".hyperacc-probe-"))
    except OSError as exc:
        return f"cannot write in {here}: {exc.strerror or exc}"
    return None


class OutputFile(click.ParamType):
    """A file the command will write: not empty, not a directory, its folder writable. With
    ``make_parents`` a missing folder is fine (the command creates it); otherwise it must exist.
    Checked before the command reads or computes anything; nothing is created here."""

    name = "file"

    def __init__(self, make_parents: bool = True) -> None:
        self.make_parents = make_parents

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if not text.strip():
            self.fail("the file name is empty; give the path of the file to write", param, ctx)
        path = Path(text).expanduser()
        if text.endswith(os.sep) or path.is_dir():
            self.fail(f"{text} is a directory; give a file name inside it", param, ctx)
        if path.exists() and not path.is_file():  # a device or a pipe would be replaced, not written
            self.fail(f"{text} exists and is not a regular file; give another file name", param, ctx)
        if not self.make_parents and not path.parent.is_dir():
            self.fail(f"the folder {path.parent} does not exist; create it first", param, ctx)
        problem = _creatable(path.parent)
        if problem is not None:
            self.fail(problem, param, ctx)
        return text


class OutputDir(click.ParamType):
    """A directory the command will create (if missing) and write into: not empty, not a file, and
    creatable. Nothing is created here."""

    name = "directory"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
        if not text.strip():
            self.fail("the directory is empty; give a path such as runs/exp1", param, ctx)
        path = Path(text).expanduser()
        problem = _creatable(path)
        if problem is not None:
            self.fail(problem, param, ctx)
        return path


def typed_options(ctx: click.Context | None = None) -> set[str]:
    """The options the user gave on the command line (``"--top"``), not those left at their default."""
    ctx = ctx or click.get_current_context()
    out = set()
    for param in ctx.command.params:
        if param.name and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE:
            out.update(o for o in param.opts if o.startswith("--"))
    return out


def option_error(
    exc: Exception, options: Mapping[str, str], default: str | None = None, typed: set[str] | None = None
) -> click.BadParameter:
    """A configuration's ``ValueError`` as one line naming the option the user typed.

    ``options`` maps configuration field names to option names (``{"top_events": "--top"}``); the
    field named in the message picks the option (longest name first; among several, one the user
    typed, ``typed``, comes first), else ``default``.
    """
    message = str(exc)
    named = [
        field for field in sorted(options, key=len, reverse=True)
        if re.search(rf"(?<![\w-]){re.escape(field)}(?![\w-])", message)
    ]  # fmt: skip
    if typed:
        named.sort(key=lambda field: options[field] not in typed)  # stable: typed ones first
    if named:
        return click.BadParameter(message, param_hint=f"'{options[named[0]]}'")
    return click.BadParameter(message, param_hint=f"'{default}'" if default else None)


def existing_run_dirs(text: str, param_hint: str) -> str | list[str]:
    """``run_dirs_of(text)``, each directory checked to exist (exit status 2 naming it when one does not:
    a path mistyped is bad input). What a run directory holds is the reader's to judge: a directory
    without records the command can use is exit status 1 (docs/reliability.md, "Exit status")."""
    dirs = run_dirs_of(text)
    for d in [dirs] if isinstance(dirs, str) else dirs:
        if not str(d).strip():
            raise click.BadParameter("the run directory is empty; pass the --run-dir of a traced job",
                                     param_hint=param_hint)  # fmt: skip
        if not Path(d).is_dir():
            raise click.BadParameter(f"{d} does not exist or is not a directory; pass the --run-dir of a traced job",
                                     param_hint=param_hint)  # fmt: skip
    return dirs


def run_dirs_of(text: str) -> str | list[str]:
    """One job's run directories from one argument: a directory, or several joined by commas (one per
    agent on nodes with local disks; docs/presentation.md, "Several run directories of one job"). A
    path that exists as written is one directory, commas and all."""
    if "," not in text or Path(text).exists():
        return text
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else parts
