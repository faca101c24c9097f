"""Run a command and print, as one JSON line on stderr's last line, what its whole process tree used:
the largest resident set of any process in it and the CPU time of all of them (RUSAGE_CHILDREN covers
every descendant that was waited for, which torchrun does for its ranks); and what the command's own
process used, without its descendants, sampled every 0.1 s until it exits (peak RSS, CPU time): torchrun's
launcher in a plain run, ``hyperacc run`` (the node agent) in a traced one."""

import json
import resource
import subprocess
import sys
import time

import psutil

proc = subprocess.Popen(sys.argv[1:])
own_rss = own_cpu = 0.0
try:
    me = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            own_rss = max(own_rss, me.memory_info().rss / 2**20)
            t = me.cpu_times()
            own_cpu = t.user + t.system
        except psutil.Error:
            pass
        time.sleep(0.1)
except psutil.Error:
    pass
rc = proc.wait()
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": rc, "maxrss_mib": use.ru_maxrss / 1024, "cpu_s": use.ru_utime + use.ru_stime,
                  "own_rss_mib": own_rss, "own_cpu_s": own_cpu}), file=sys.stderr)
sys.exit(rc)
