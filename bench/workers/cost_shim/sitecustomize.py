"""Measurement shim of bench/rank_cost.py, loaded by every rank through PYTHONPATH (plain and traced alike).

It counts optimizer steps with torch's global step post-hook (the same for both arms) and writes, at the
first step and then every 50 steps after warm-up, the rank's process CPU time (all threads), its peak RSS
and the step count to ``$RANK_COST_OUT/rank-<RANK>.json``. Writing once per 50 steps keeps the shim's own
cost equal and negligible in both arms; the last file written is the measurement.
"""

import os

_OUT = os.environ.get("RANK_COST_OUT")
if _OUT and os.environ.get("RANK") is not None:
    import json
    import resource
    import sys
    import time

    _state = {"n": 0, "warm": None}
    _WARMUP = int(os.environ.get("RANK_COST_WARMUP", "50"))
    _path = os.path.join(_OUT, f"rank-{os.environ['RANK']}.json")

    def _write(record: dict) -> None:
        tmp = _path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, _path)

    def _post(optimizer, args, kwargs) -> None:  # noqa: ANN001
        _state["n"] += 1
        n = _state["n"]
        if n == 1:
            _state["startup"] = time.process_time()
        if n == _WARMUP:
            _state["warm"] = time.process_time()
        if n == 1 or (n > _WARMUP and (n - _WARMUP) % 50 == 0):
            now = time.process_time()
            _write({
                "startup_cpu_s": _state["startup"],
                "steps": n - _WARMUP if _state["warm"] is not None else 0,
                "steady_cpu_s": now - _state["warm"] if _state["warm"] is not None else 0.0,
                "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "hyperacc": any(m.startswith("hyperacc") for m in sys.modules),
            })

    # torch is imported here rather than when the script first imports it: both arms pay it the same.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_post)
