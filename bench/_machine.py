"""The one-line description of this machine that every benchmark prints beside its numbers."""

from __future__ import annotations

import os
import platform


def describe() -> str:
    import psutil
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    mem = psutil.virtual_memory().total / 2**30
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, {mem:.0f} GiB RAM, {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}; load average {load}"
    )
