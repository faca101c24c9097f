"""Replay recorded runs through the live rules: what the node agent that judges every rank would have
said (``analysis.live_episodes``: each rank's episodes and the job's own slowdowns) beside what
``hyperacc analyze`` says of the whole run (docs/detection.md, "Episodes" and "Slowdowns of the job",
Live).

Each rank's records are read whole and handed to the live rules in chunks of ``--chunk`` steps a rank
(a random size in that range per rank and pass, as flushes arrive), in ``--orders`` random arrival
orders. Printed per run: the live lines about the job and the number of lines about ranks, and, with
``--offline``, the slowdowns ``analyze`` finds. No timing: this checks what is said, not what it costs
(``bench/live_aggregation.py`` measures that).

    .venv/bin/python bench/live_replay.py RUN_DIR [RUN_DIR ...] --offline
    find /tmp -name steps -type d | sed 's#/steps$##' | .venv/bin/python bench/live_replay.py --stdin
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hyperacc import store  # noqa: E402
from hyperacc.analysis import diagnose  # noqa: E402
from hyperacc.analysis.live_episodes import BlockStream, LiveEpisodes  # noqa: E402
from hyperacc.analysis.options import DetectionOptions  # noqa: E402

MAX_ROWS = 400_000  # larger runs are skipped: this reads every rank whole


def rank_columns(run_dir: str) -> dict[int, tuple[dict[str, np.ndarray], int]] | None:
    """Each rank's columns the live rules read, in step order, and its node; None: nothing to replay."""
    table = store.read_steps(run_dir)
    if table.num_rows == 0 or table.num_rows > MAX_ROWS:
        return None
    names = [c for c in BlockStream._NAMES if c in table.column_names]
    ranks = np.asarray(table["rank"])
    nodes = np.asarray(table["node"]) if "node" in table.column_names else np.zeros(table.num_rows, dtype=np.int64)
    steps = np.asarray(table["step"])
    out = {}
    for r in np.unique(ranks):
        m = ranks == r
        order = np.argsort(steps[m], kind="stable")
        cols = {c: np.asarray(table[c].to_numpy(zero_copy_only=False), dtype=np.int64 if c == "step" else np.float64)[m][order]
                for c in names}  # fmt: skip
        out[int(r)] = (cols, int(nodes[m][0]))
    return out


def replay(per_rank: dict[int, tuple[dict[str, np.ndarray], int]], seed: int, chunk: tuple[int, int]) -> list[tuple[int, str]]:
    """What the judging agent says of these ranks' records, arriving in random chunks (seeded)."""
    rng = np.random.default_rng(seed)
    opts = DetectionOptions()
    streams = {r: BlockStream(r, node, opts) for r, (_, node) in per_rank.items()}
    pos = dict.fromkeys(per_rank, 0)
    live, said = LiveEpisodes(opts), []
    while any(pos[r] < cols["step"].size for r, (cols, _) in per_rank.items()):
        blocks = []
        for r, (cols, _) in per_rank.items():
            a = pos[r]
            b = min(a + int(rng.integers(chunk[0], chunk[1] + 1)), cols["step"].size)
            if a < b:
                blocks.append(streams[r].add({k: v[a:b] for k, v in cols.items()}))
            pos[r] = b
        said += live.update(blocks)
    return said + live.update([s.close() for s in streams.values()]) + live.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run directories")
    ap.add_argument("--stdin", action="store_true", help="read run directories from standard input, one a line")
    ap.add_argument("--orders", type=int, default=2, help="random arrival orders per run")
    ap.add_argument("--chunk", type=int, nargs=2, default=(5, 40), metavar=("LEAST", "MOST"),
                    help="steps a rank's records arrive in per pass")  # fmt: skip
    ap.add_argument("--offline", action="store_true", help="also the slowdowns `analyze` finds")
    args = ap.parse_args()
    runs = list(args.runs) + ([line.strip() for line in sys.stdin if line.strip()] if args.stdin else [])
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    replayed = with_lines = 0
    for run in runs:
        try:
            per_rank = rank_columns(run)
        except (store.RunDirError, OSError, ValueError) as exc:
            print(json.dumps({"run": run, "error": str(exc)[:200]}), flush=True)
            continue
        if per_rank is None:
            continue
        replayed += 1
        row: dict[str, Any] = {"run": run, "ranks": len(per_rank), "orders": []}
        for seed in range(args.orders):
            said = replay(per_rank, seed, tuple(args.chunk))
            job = [line for _, line in said if line.startswith("the job")]
            row["orders"].append({"job": job, "rank_lines": len(said) - len(job)})
        if args.offline:
            row["offline"] = [{k: s[k] for k in ("since_step", "until_step", "slowdown", "kind", "ranks")}
                              for s in diagnose(run).slowdowns]  # fmt: skip
        with_lines += any(o["job"] for o in row["orders"])
        print(json.dumps(row), flush=True)
    print(f"# {replayed} runs replayed, {with_lines} with a live line about the job", file=sys.stderr)


if __name__ == "__main__":
    main()
