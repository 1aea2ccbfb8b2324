#!/usr/bin/python3
"""Write every EFA port's hw_counters as Prometheus text (node exporter's textfile collector).

/sys/class/infiniband/<device>/ports/<port>/hw_counters/<name> holds one integer per file
(rdma_read_bytes, rdma_write_bytes, rx_bytes, tx_bytes, send_bytes, recv_bytes, ...); each becomes
fsdp_efa_<name>_total{device, port}. The file is written atomically (rename).

    fsdp-efa-counters OUTPUT.prom [SYSFS_ROOT]   (SYSFS_ROOT: / unless testing)
"""
import glob
import os
import re
import sys

out = sys.argv[1]
base = os.path.join(sys.argv[2] if len(sys.argv) > 2 else "/", "sys/class/infiniband")
lines = {}
for path in sorted(glob.glob(os.path.join(base, "*/ports/*/hw_counters/*"))):
    device, _, port, _, name = os.path.relpath(path, base).split(os.sep)
    try:
        with open(path) as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        continue
    metric = "fsdp_efa_" + re.sub(r"[^a-zA-Z0-9_]", "_", name) + "_total"
    lines.setdefault(metric, []).append(f'{metric}{{device="{device}",port="{port}"}} {value}')
text = "".join(f"# TYPE {m} counter\n" + "\n".join(v) + "\n" for m, v in sorted(lines.items()))
tmp = out + ".tmp"
with open(tmp, "w") as f:
    f.write(text)
os.replace(tmp, out)
