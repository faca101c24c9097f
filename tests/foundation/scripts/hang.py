"""Rank 0 hangs forever; the harness must kill the whole job at its timeout."""

import os
import time

from hyperacc import harness

with open(os.path.join(os.environ["HYPERACC_RESULT_DIR"], f"pid-{os.environ['RANK']}"), "w") as fh:
    fh.write(str(os.getpid()))
if os.environ["RANK"] == "0":
    while True:
        time.sleep(1)
harness.write_result({"rank": int(os.environ["RANK"])})
