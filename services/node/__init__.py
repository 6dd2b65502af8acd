"""The node service: holds a contiguous range of a model's layers and serves them.

Before torch loads, a node asks OpenMP to let idle worker threads sleep
(`OMP_WAIT_POLICY=PASSIVE`, unless the environment says otherwise). With the
default policy, threads spin after every parallel region; several processes
on one machine (a local mesh, a tracker, another node) then steal each
other's cores, and measured on this 2-core machine a 2-node SmolLM2 mesh fell
from 34 ms to over 1 s a token under load, the tiny model's 2-node mesh from
3.7 to 43 ms. Passive waiting keeps a node's cost near the 1-thread figure
when cores are shared, and still uses every core when they are free.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
