"""Presenting a run: HTML report, Chrome/Perfetto export, Kineto import, Prometheus metrics.

Each module reads the shared run directory (``hyperacc.schema``) and writes one thing; none of them
runs on the training thread.
"""
