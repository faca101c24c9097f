"""Run a command and print, as one JSON line on stderr's last line, what its whole process tree used:
the largest resident set of any process in it and the CPU time of all of them (RUSAGE_CHILDREN covers
every descendant that was waited for, which torchrun does for its ranks)."""

import json
import resource
import subprocess
import sys

rc = subprocess.call(sys.argv[1:])
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "maxrss_mib": use.ru_maxrss / 1024, "cpu_s": use.ru_utime + use.ru_stime}), file=sys.stderr)
sys.exit(rc)
