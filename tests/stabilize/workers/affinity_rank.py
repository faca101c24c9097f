"""A rank that binds itself with the stabilizer and reports the masks its threads and loader workers got."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, get_worker_info

from hyperacc import harness
from hyperacc.stabilize import stabilize
from hyperacc.stabilize.affinity import thread_affinities

USER_INIT_CALLED = False


def user_init(worker_id: int) -> None:
    global USER_INIT_CALLED
    USER_INIT_CALLED = True


class Probe(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> str:
        info = get_worker_info()
        return json.dumps(
            {
                "worker": info.id,
                "cpus": sorted(os.sched_getaffinity(0)),
                "gc": gc.isenabled(),
                "user": USER_INIT_CALLED,
            }
        )


def main() -> None:
    workers = int(sys.argv[1])
    dist.init_process_group("gloo")
    stab = stabilize(affinity={"workers_per_rank": workers}, memory=False)
    loader = stab.attach(
        DataLoader(Probe(), batch_size=None, num_workers=workers, worker_init_fn=user_init,
                   multiprocessing_context="fork")
    )  # fmt: skip
    samples = [json.loads(s) for s in loader]
    result = {
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "binding": stab.binding.to_dict() if stab.binding else None,
        "threads": {str(t): sorted(m) for t, m in thread_affinities().items()},
        "torch_threads": torch.get_num_threads(),
        "workers": samples,
        "disabled": stab.disabled,
    }
    stab.close()
    harness.write_result(result)
    harness.finish()


if __name__ == "__main__":
    main()
