"""One options layer: how every configurable part of hyperacc is read, checked and refused.

Each part keeps its settings in a frozen dataclass beside the code that uses them (``TraceOptions``,
``DetectionOptions``, ``StabilizeConfig``, ``RemediationConfig``, ``DoctorOptions``, ``PacingConfig``,
the chaos ``Fault``); this module is what they share:

* ``check_fields(obj, section)``, called first in every ``__post_init__``: each field has the type its
  annotation names. Integers are integers (``1.5``, ``"two"`` and ``True`` are not), numbers are finite,
  a ``tuple[int, ...]`` field takes a list; ints given for a float field become floats.
* ``load(cls, values, section)``: a mapping (parsed JSON, TOML, keyword arguments) to the dataclass;
  unknown keys are refused with the known ones.
* ``parse_json``, ``read_file`` (TOML or JSON; ``tomllib``, ``tomli`` on Python 3.10) and
  ``env_text``: the one place where option text is parsed.
* ``OptionsError`` (a ``ValueError``): the one error of every option, one line that names it::

      remediation.max_drains=1.5 is invalid: max_drains must be an integer
      unknown trace option(s) ['windw']; known: alloc_every, capacity, ...
      policy.toml: stabilize.memory.interval=0 is invalid: memory.interval must be a whole number ...

  The old per-part names (``TraceConfigError``, ``RemediationConfigError``, ...) are aliases of it.

Imports nothing heavy (no numpy, pyarrow or torch): a rank reads its options before anything else.
docs/options.md describes the layer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class OptionsError(ValueError):
    """An unknown, mistyped or impossible option; the message names it (``section.name``) and what is
    allowed. ``section``, ``name``, ``value`` and ``allowed`` are set when one option is at fault."""

    def __init__(
        self,
        message: str,
        *,
        section: str | None = None,
        name: str | None = None,
        value: Any = None,
        allowed: str | None = None,
    ) -> None:
        super().__init__(message)
        self.section, self.name, self.value, self.allowed = section, name, value, allowed

    def within(self, section: str) -> OptionsError:
        """The same fault reported under ``section`` (an option one part passes on to another)."""
        if self.name is None or self.allowed is None:
            return self
        return invalid(section, self.name, self.value, self.allowed)


def invalid(section: str, name: str, value: Any, allowed: str) -> OptionsError:
    """``section.name=value is invalid: name must be allowed``."""
    return OptionsError(
        f"{section}.{name}={value!r} is invalid: {name} must be {allowed}",
        section=section, name=name, value=value, allowed=allowed,
    )  # fmt: skip


def check(section: str, name: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise ``invalid(...)`` unless ``ok``."""
    if not ok:
        raise invalid(section, name, value, allowed)


def unknown(section: str | None, names: Any, known: Any, what: str = "option", plain: bool = False) -> OptionsError:
    """``unknown <section> option(s) ['x']; known: ...``. The unknown names are quoted, so that a stray
    space or an odd character shows; ``plain`` lists them bare (the tracer's message as it always was)."""
    label = f"{section} {what}" if section else what
    listed = ", ".join(sorted(names)) if plain else str(sorted(names))
    return OptionsError(f"unknown {label}(s) {listed}; known: {', '.join(sorted(known))}")


def refuse_unknown(
    section: str | None, values: Mapping[str, Any], known: Any, what: str = "option", plain: bool = False
) -> None:
    extra = set(values) - set(known)
    if extra:
        raise unknown(section, extra, known, what, plain)


# ---------------------------------------------------------------------- types from annotations

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _members(hint: Any) -> tuple[Any, ...] | None:
    """The members of a union (``int | None``, ``Optional[int]``), or None for any other type."""
    if typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType):
        return typing.get_args(hint)
    return None


def _words(hint: Any) -> str:
    """What a value of ``hint`` is, in words."""
    members = _members(hint)
    if members is not None:
        named = [_words(m) for m in members if m is not type(None)]
        text = " or ".join(named)
        return f"{text} or null" if type(None) in members else text
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return "a list" if item is Any else f"a list of {_plural(item)}"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _plural(hint: Any) -> str:
    return {bool: "true/false values", int: "integers", float: "finite numbers", str: "strings"}.get(
        hint, _words(hint)
    )


_NO = object()  # "does not fit" (None is a value)


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` wants it, or ``_NO`` when it does not fit."""
    members = _members(hint)
    if members is not None:
        if value is None:
            return None if type(None) in members else _NO
        for m in members:
            if m is not type(None):
                out = _convert(value, m)
                if out is not _NO:
                    return out
        return _NO
    if hint is bool:
        return value if isinstance(value, bool) else _NO
    if hint is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return int(value) if ok else _NO
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _NO
        v = float(value)
        return v if math.isfinite(v) else _NO
    if hint is str:
        return value if isinstance(value, str) else _NO
    if typing.get_origin(hint) is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            return _NO
        args = typing.get_args(hint)
        item = args[0] if args else Any
        out = tuple(_convert(v, item) for v in value)
        return _NO if any(v is _NO for v in out) else out
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return value if isinstance(value, hint) else _NO
    return value  # Any and other annotations: the part checks them itself


def check_fields(obj: Any, section: str, prefix: str = "") -> None:
    """Check every field of the dataclass ``obj`` against its annotation and store the converted value
    (an int for a float field becomes a float, a list for a tuple field a tuple). Call it first in
    ``__post_init__``, before any range check compares values."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = hints.get(f.name, Any)
        out = _convert(value, hint)
        if out is _NO:
            raise invalid(section, prefix + f.name, value, _words(hint))
        if out is not value:
            object.__setattr__(obj, f.name, out)


def load(
    cls: type[T],
    values: Mapping[str, Any],
    section: str,
    *,
    source: str | None = None,
    prefix: str = "",
    plain: bool = False,
) -> T:
    """The dataclass ``cls`` from ``values``: unknown keys refused, each value checked against its
    field's annotation, then constructed (``__post_init__`` checks the ranges). ``prefix`` names a
    nested part (``"faults[0]."``: ``unknown chaos.faults[0] option(s)``, ``chaos.faults[0].rate``); ``source`` (a file,
    an environment variable) starts the message when given."""
    try:
        if not isinstance(values, Mapping):
            raise OptionsError(f"{section} options must be a table of settings (got {type(values).__name__})")
        known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        extra = set(values) - set(known)
        if extra:
            raise unknown(f"{section}.{prefix.rstrip('.')}" if prefix else section, extra, known, plain=plain)
        hints = _hints(cls)
        checked = {}
        for name, value in values.items():  # types first, so that no range check compares a mistyped value
            out = _convert(value, hints.get(name, Any))
            if out is _NO:
                raise invalid(section, prefix + name, value, _words(hints.get(name, Any)))
            checked[name] = out
        try:
            return cls(**checked)
        except OptionsError:
            raise
        except TypeError as exc:  # a required field missing, or a part's own check comparing types
            raise OptionsError(f"{section} options: {exc}") from None
        except ValueError as exc:  # a part that raises ValueError itself (the one type from here on)
            raise OptionsError(str(exc)) from None
    except OptionsError as exc:
        raise (OptionsError(f"{source}: {exc}") if source else exc) from None


# ---------------------------------------------------------------------- text: JSON, TOML, environment


def env_text(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The environment variable ``name``, stripped ("" when unset)."""
    return (os.environ if environ is None else environ).get(name, "").strip()


def parse_json(text: str, source: str, example: str = "") -> dict[str, Any]:
    """A JSON object from ``text``; ``source`` (an option or variable name) is named in the error."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        hint = f"; pass an object such as {example}" if example else ""
        raise OptionsError(f"{source} is not valid JSON ({exc}){hint}") from None
    if not isinstance(value, dict):
        raise OptionsError(f"{source} must be a JSON object (got {type(value).__name__})")
    return value


def parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as a package (a declared dependency there)
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise OptionsError(f"{source}: reading TOML needs Python >= 3.11 or `pip install tomli`; or use JSON") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise OptionsError(f"{source} is not valid TOML ({exc}); fix the file") from None


def read_file(path: str | os.PathLike, what: str = "options file") -> dict[str, Any]:
    """A TOML file, or JSON when it ends in ``.json``; ``what`` names the file in errors."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise OptionsError(f"cannot read {what} {p}: {reason}; pass an existing file") from None
    if p.suffix.lower() == ".json":
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise OptionsError(f"{p} is not valid JSON ({exc}); fix the file") from None
        if not isinstance(value, dict):
            raise OptionsError(f"{p} must hold a JSON object (got {type(value).__name__})")
        return value
    return parse_toml(text, str(p))


def table(values: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``values[name]`` when a file holds its settings in a ``[name]`` table, else ``values`` itself."""
    inner = values.get(name)
    return dict(inner) if isinstance(inner, Mapping) else dict(values)
