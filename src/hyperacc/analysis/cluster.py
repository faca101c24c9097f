"""The per-rank reduction of ``diagnose`` on a Dask distributed cluster, for runs that outgrow one machine.

``diagnose`` reads and reduces one rank at a time (``reduce_source``: ``columns.read_rank`` then
``run_reduce.reduce_rank``, or both in chunks for a long rank; a pure function of that rank's records)
and keeps only each rank's small findings. That map is what
runs on the cluster: every worker reads its ranks' segments from the shared file system the run
directory lives on and sends back the findings; the rest of ``diagnose`` (window summaries of all ranks,
stragglers, spikes, projection) runs here as before, on the findings alone. The result is the same as
on one machine (tested on a local two-worker cluster).

Why Dask and not Ray: the unit of work is a plain function over a list of Parquet paths returning numpy
arrays; Dask distributed ships such functions with cloudpickle to workers that are started with one
command on Slurm (``dask-scheduler`` / ``dask-worker``, or dask-jobqueue's ``SLURMCluster``) or
Kubernetes (the Dask operator), and reads the same shared paths. Nothing of Ray's actor model or object
store is needed. docs/detection.md, "Analysis on a cluster", has the commands.

Install with ``pip install 'hyperacc[cluster]'``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from hyperacc.analysis.columns import NotInChunks, RankSource, read_rank, read_rank_chunks, step_bounds
from hyperacc.analysis.options import DetectionOptions
from hyperacc.analysis.run_reduce import RankFindings, reduce_rank, reduce_rank_chunks


class ClusterError(ValueError):
    """The cluster named by ``--cluster`` cannot be used (not installed, not reachable): bad input, exit 2."""


IN_FLIGHT_PER_WORKER = 4  # ranks submitted ahead per worker: enough to keep workers busy, bounded memory here


def reduce_source(node: int, src: RankSource, opts: DetectionOptions) -> RankFindings | None:
    """One rank's findings (``None`` when it recorded no step): what every worker runs, and ``diagnose``
    on one machine. A rank whose segments span more than ``rank_chunk_steps`` steps is read and reduced
    in chunks of that many (``run_reduce.reduce_rank_chunks``: the same findings, never the whole rank
    in memory), unless its segments overlap or are out of order; then it is read whole."""
    if len(src.segments) >= 2:
        first, last = step_bounds(src.segments[:1]), step_bounds(src.segments[-1:])
        if first and last and last[1] - first[0] + 1 > opts.rank_chunk_steps:
            try:
                return reduce_rank_chunks(
                    src.rank, node, lambda: read_rank_chunks(src.segments, opts.rank_chunk_steps), opts
                )
            except NotInChunks:
                pass
    cols = read_rank(src.segments)
    if cols["step"].size == 0:
        return None
    return reduce_rank(src.rank, node, cols, opts)


def connect(address: str) -> Any:
    """A ``dask.distributed.Client`` of the scheduler at ``address`` (e.g. ``tcp://10.0.0.5:8786``)."""
    try:
        import dask
        from dask.distributed import Client
    except ModuleNotFoundError:
        raise ClusterError(
            f"--cluster {address}: Dask distributed is not installed; install it with "
            "`pip install 'hyperacc[cluster]'`"
        ) from None
    try:
        # Dask's own connect timeout (30 s unless set, e.g. DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT=5s)
        return Client(address, timeout=dask.config.get("distributed.comm.timeouts.connect"))
    except (OSError, TimeoutError) as exc:
        raise ClusterError(
            f"--cluster {address}: could not reach a Dask scheduler there ({exc}); start one with "
            "`dask-scheduler` and workers with `dask-worker ADDRESS` (docs/detection.md, 'Analysis on a cluster')"
        ) from None


def reduced_on_cluster(
    order: list[tuple[int, RankSource]], opts: DetectionOptions, address: str
) -> Iterator[RankFindings | None]:
    """Findings of each rank in ``order``, reduced on the cluster at ``address``, yielded in order.

    At most ``IN_FLIGHT_PER_WORKER`` ranks per worker are pending at once, so the findings waiting here
    stay bounded whatever the number of ranks."""
    client = connect(address)
    try:
        workers = max(1, len(client.scheduler_info().get("workers", {})))
        limit = IN_FLIGHT_PER_WORKER * workers
        pending: collections.deque[Any] = collections.deque()
        [opts_future] = client.scatter([opts], broadcast=True)
        for node, src in order:
            pending.append(client.submit(reduce_source, node, src, opts_future, pure=False))
            if len(pending) >= limit:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        client.close()
