"""The exclusion file: hosts a launcher should leave out, one name per line.

The format is what launchers read directly: Slurm takes it as ``--exclude=/path/to/file`` (a path with a
``/``), and a shell turns it into a comma list with ``paste -sd, FILE``. Lines starting with ``#`` are
comments. Entries are only ever added: a host that was left out once stays out until a person removes
its line (docs/remediation.md, "Exclusion file").

A node's name is ``HYPERACC_NODE_NAME`` when set (several agents on one machine, or a scheduler's
own node names), else the host name.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterable
from pathlib import Path

NODE_NAME_ENV = "HYPERACC_NODE_NAME"


def node_name() -> str:
    """The name a launcher knows this node by."""
    return os.environ.get(NODE_NAME_ENV, "").strip() or socket.gethostname()


def read_exclusions(path: str | os.PathLike) -> list[str]:
    """Host names in an exclusion file, in file order, without comments or duplicates; [] if absent."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    names: list[str] = []
    for line in text.splitlines():
        name = line.split("#", 1)[0].strip()
        if name and name not in names:
            names.append(name)
    return names


def add_exclusions(path: str | os.PathLike, hosts: Iterable[str], comment: str | None = None) -> list[str]:
    """Append the hosts not yet listed (under an exclusive lock, fsynced); returns the ones added.

    The file is created when missing, even with nothing to add, so a launcher can always read it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wanted = [h.strip() for h in hosts if h and h.strip()]
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.seek(0)
            present = set()
            for line in fh.read().splitlines():
                name = line.split("#", 1)[0].strip()
                if name:
                    present.add(name)
            added = []
            for host in wanted:
                if host not in present and host not in added:
                    added.append(host)
            if added:
                note = f"  # {comment}" if comment else ""
                fh.write("".join(f"{h}{note}\n" for h in added))
                fh.flush()
                os.fsync(fh.fileno())
            return added
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
