"""A compaction killed (SIGKILL) at a chosen point (run by test_compaction.py).

argv: RANK_DIR WHERE. The rank directory already holds small step segments (and maybe a compacted
file of the open period); ``store.compact`` runs with a fault hook that kills this process with
SIGKILL at WHERE: "write" (the compacted file written to its temporary name, not renamed), or
"unlink-K" (renamed into place, K of the replaced files removed).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pyarrow.parquet as pq

from hyperacc import store
from hyperacc.schema import STEP_SCHEMA


def main() -> None:
    rank_dir, where = Path(sys.argv[1]), sys.argv[2]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "write":
        real_write = pq.write_table

        def write_then_die(table, where_to, **kw):  # noqa: ANN001, ANN003, ANN202
            real_write(table, where_to, **kw)
            die()

        pq.write_table = write_then_die
    else:
        left = int(where.split("-")[1])
        real_unlink = Path.unlink

        def unlink_then_die(self: Path, missing_ok: bool = False) -> None:
            nonlocal left
            if left == 0:
                die()
            left -= 1
            real_unlink(self, missing_ok=missing_ok)

        Path.unlink = unlink_then_die  # type: ignore[method-assign]
    store.compact(rank_dir, STEP_SCHEMA, every=1)
    print("not killed", flush=True)


if __name__ == "__main__":
    main()
