"""The exclusion file: hosts a launcher should leave out, one name per line and nothing else on it.

The format is what launchers and scripts read directly: Slurm takes it as ``--exclude=/path/to/file``
(a path with a ``/``), a shell turns it into a comma list with ``paste -sd, FILE``, and a script that
taints Kubernetes nodes reads it line by line. So hyperacc writes host names only, each on its own line,
never a comment (who added a host and why is in the event log and in the command's output). A person
may add ``#`` comment lines by hand; hyperacc skips them when reading and keeps them when it writes
(then use ``grep -v '^#' FILE | paste -sd,``). Entries are only ever added: a host that was left out
once stays out until a person removes its line (docs/remediation.md, "Exclusion file").

A write never loses a host already there: the file is rewritten whole under a lock (its folder's
``flock``) into a temporary file beside it, fsynced and renamed over the old one, so a reader sees the
old file or the new one, and a line a person typed without a final newline stays a line of its own.

A node's name is ``HYPERACC_NODE_NAME`` when set (several agents on one machine, or a scheduler's
own node names), else the host name.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

NODE_NAME_ENV = "HYPERACC_NODE_NAME"


def node_name() -> str:
    """The name a launcher knows this node by."""
    return os.environ.get(NODE_NAME_ENV, "").strip() or socket.gethostname()


def check_host_name(name: str) -> str:
    """``name`` stripped, or ValueError when a launcher could not read it back as one host."""
    host = name.strip()
    if not host or any(c.isspace() for c in host) or "#" in host or "," in host:
        raise ValueError(f"{name!r} is not a host name a launcher can read (empty, or holds a space, '#' or ','); "
                         f"set {NODE_NAME_ENV} to the name the scheduler knows the node by")  # fmt: skip
    return host


def _entries(text: str) -> tuple[list[str], list[str]]:
    """(lines to keep, host names) of an exclusion file's text. A line ``host  # note`` (written by
    an older hyperacc, or by hand) becomes ``# note`` above ``host``, so every host line is a name."""
    lines: list[str] = []
    names: list[str] = []
    for raw in text.splitlines():
        body, hash_, note = raw.partition("#")
        name = body.strip()
        if not name:
            if raw.strip():
                lines.append(raw.rstrip())
            continue
        if hash_ and note.strip():
            lines.append(f"# {note.strip()}")
        if name not in names:
            names.append(name)
            lines.append(name)
    return lines, names


def read_exclusions(path: str | os.PathLike) -> list[str]:
    """Host names in an exclusion file, in file order, without comments or duplicates; [] if absent."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return _entries(text)[1]


def writable_problem(path: str | os.PathLike) -> str | None:
    """Why the exclusion file at ``path`` could not be written, or None when it can: checked before
    a command measures anything, so a bad path fails at once. Leaves nothing behind (a probe file
    is created in the folder and removed at once)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        return f"{path} exists and is not a regular file"
    folder = path.parent
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    try:  # probed, not inferred from permission bits: root may write anywhere but in /proc or a read-only mount
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".hyperacc-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot create files in {folder}: {exc.strerror or exc}"
    if path.exists() and not os.access(path, os.R_OK):
        return f"{path} is not readable"
    return None


def add_exclusions(path: str | os.PathLike, hosts: Iterable[str]) -> list[str]:
    """Add the hosts not yet listed, each on its own line; returns the ones added.

    The file is created when missing, even with nothing to add, so a launcher can always read it.
    Raises ValueError for a name a launcher could not read back (``check_host_name``), OSError when
    the file cannot be written (the old file is then unchanged).
    """
    path = Path(path)
    wanted = [check_host_name(h) for h in hosts if h and h.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # the file itself is replaced, so the lock is its folder's
        try:
            try:
                old = path.read_text()
            except FileNotFoundError:
                old = None
            lines, present = _entries(old or "")
            added = [h for i, h in enumerate(wanted) if h not in present and h not in wanted[:i]]
            new = "".join(f"{line}\n" for line in [*lines, *added])
            if old is not None and new == old:
                return added
            _replace(path, new)
            os.fsync(folder)
            return added
        finally:
            fcntl.flock(folder, fcntl.LOCK_UN)
    finally:
        os.close(folder)


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        except FileNotFoundError:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
