"""`fsdpctl monitor`: a per-node view of the cluster from Prometheus on node 0.

Prometheus (ansible/roles/monitoring) listens on node 0's cluster address only, so every query goes
through an SSH tunnel to node 0 opened with the cluster's own SSH settings (key, known_hosts,
bastion hop): `ssh -N -L 127.0.0.1:<free port>:<node 0 address>:9090`. The same tunnel serves the
smoke test's `monitoring` check (fsdpctl/checks/monitoring.py).

Per node: GPU utilisation and memory (dcgm-exporter), host CPU and memory, network receive/transmit
against the link's capacity, EFA throughput (hw_counters), and the tokens/s of the training ranks
running there (the trainer's textfile metrics).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from argparse import Namespace
from typing import Any

from fsdpctl import remote
from fsdpctl.console import print_json, say
from fsdpctl.errors import CommandError
from fsdpctl.state import ClusterRecord, resolve_cluster
from infra.catalog import CATALOG
from infra.spec import ClusterSpec

PROMETHEUS_PORT = 9090  # monitoring_prometheus_port in ansible/roles/monitoring/defaults/main.yml
PROMETHEUS_RANK = 0  # monitoring_server_rank
TUNNEL_TIMEOUT_S = 20
REFUSED_TRIES = 10  # connections node 0 refused in a row (0.2 s apart) before giving up early
QUERY_TIMEOUT_S = 20
RATE_WINDOW = "10s"  # several scrapes at the role's interval (1 s local, 2 s AWS)
LIVE_S = 30
NETDEV = 'device!="lo"'  # a trainer file not updated for this long is a finished or hung job


class PrometheusError(CommandError):
    """Prometheus could not be reached or refused a query."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Prometheus's HTTP API on node 0 through an SSH tunnel; use as a context manager."""

    def __init__(self, record: ClusterRecord):
        self.record = record
        self.node = remote.node_by_rank(record, PROMETHEUS_RANK)
        self.local_port = _free_port()
        self._tunnel: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def __enter__(self) -> Prometheus:
        argv = remote.ssh_argv(self.record, self.node, "", shared=False)[:-1]  # no remote command: -N
        forward = f"127.0.0.1:{self.local_port}:{self.node.address}:{PROMETHEUS_PORT}"
        argv = [argv[0], "-N", "-o", "ExitOnForwardFailure=yes", "-L", forward, *argv[1:]]
        self._tunnel = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + TUNNEL_TIMEOUT_S
        last, refused = "", 0
        while time.monotonic() < deadline:
            if self._tunnel.poll() is not None:
                err = (self._tunnel.stderr.read() if self._tunnel.stderr else "").strip()
                raise PrometheusError(f"the SSH tunnel to Prometheus on {self.node.name} "
                                      f"({self.node.address}) exited {self._tunnel.returncode}: "
                                      f"{err or 'no message'}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                last = str(e) or type(e).__name__
                # The tunnel accepted the connection but node 0 refused it (ssh closes it at once):
                # nothing listens there. A starting Prometheus answers 503 instead, and is waited for.
                dropped = isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError)) or \
                    isinstance(getattr(e, "reason", None), ConnectionResetError)
                refused = refused + 1 if dropped else 0
                if refused >= REFUSED_TRIES:
                    break
            time.sleep(0.2)
        self.close()
        why = ("refuses connections" if refused >= REFUSED_TRIES
               else f"is not ready after {TUNNEL_TIMEOUT_S} s")
        raise PrometheusError(f"Prometheus on {self.node.name} ({self.node.address}:{PROMETHEUS_PORT}) "
                              f"{why} ({last}): run "
                              "`fsdpctl configure --tags monitoring` (the monitoring role installs and "
                              "starts it)")

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._tunnel and self._tunnel.poll() is None:
            self._tunnel.terminate()
            try:
                self._tunnel.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._tunnel.kill()
                self._tunnel.wait()

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise PrometheusError(f"Prometheus refused {params.get('query')!r}: {e.code} {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PrometheusError(f"Prometheus query {params.get('query')!r} failed: {e}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus query {params.get('query')!r}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: [{"metric": labels, "value": [time, "value"]}, ...]."""
        return self._get("/api/v1/query", {"query": promql, **({"time": at} if at else {})})["result"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query: [{"metric": labels, "values": [[time, "value"], ...]}, ...]."""
        return self._get("/api/v1/query_range", {"query": promql, "start": start, "end": end,
                                                  "step": step})["result"]

    def metric_names(self) -> list[str]:
        return self._get("/api/v1/label/__name__/values", {})


def by_node(result: list[dict[str, Any]]) -> dict[str, float]:
    """Instant vector -> {node label: value}."""
    return {r["metric"].get("node", "?"): float(r["value"][1]) for r in result}


# What each column of the view is, as PromQL aggregated by the `node` label the scrape config sets.
NODE_QUERIES = {
    "up": 'up{job="node"}',
    "cpu_util": f'1 - avg by (node) (rate(node_cpu_seconds_total{{mode="idle"}}[{RATE_WINDOW}]))',
    "mem_used_bytes": "max by (node) (node_memory_MemTotal_bytes - node_memory_MemAvailable_bytes)",
    "mem_total_bytes": "max by (node) (node_memory_MemTotal_bytes)",
    "net_rx_bps": f'sum by (node) (rate(node_network_receive_bytes_total{{{NETDEV}}}[{RATE_WINDOW}])) * 8',
    "net_tx_bps": f'sum by (node) (rate(node_network_transmit_bytes_total{{{NETDEV}}}[{RATE_WINDOW}])) * 8',
    "link_bps": 'max by (node) (node_network_speed_bytes{device!="lo"}) * 8',
    "efa_rx_bps": f"sum by (node) (rate(fsdp_efa_rx_bytes_total[{RATE_WINDOW}])) * 8",
    "efa_tx_bps": f"sum by (node) (rate(fsdp_efa_tx_bytes_total[{RATE_WINDOW}])) * 8",
    "gpu_util": "avg by (node) (DCGM_FI_DEV_GPU_UTIL) / 100",
    "gpu_mem_used_bytes": "sum by (node) (DCGM_FI_DEV_FB_USED) * 1048576",
    "gpu_mem_total_bytes": "sum by (node) (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 1048576",
    "tokens_per_s": ("sum by (node) (fsdp_trainer_rank_tokens_per_second and on (job, rank, host) "
                     f"(time() - fsdp_trainer_last_update_seconds < {LIVE_S}))"),
}


def link_capacity_bps(record: ClusterRecord, spec: ClusterSpec) -> float | None:
    """The network capacity of one node from the infra catalog (AWS instance types); None on the local
    target, whose veth links report their own speed (node_network_speed_bytes)."""
    if record.target == "local":
        return None
    instance = CATALOG.get(spec.instance_type)
    return instance.network_gbps * 1e9 if instance else None


def node_view(record: ClusterRecord, spec: ClusterSpec, prom: Prometheus) -> dict[str, Any]:
    """Every node of the record, with what Prometheus has for it now (None where nothing is exported)."""
    columns = {name: by_node(prom.query(q)) for name, q in NODE_QUERIES.items()}
    catalog_link = link_capacity_bps(record, spec)
    rows = []
    for node in remote.cluster_nodes(record):
        values: dict[str, float | None] = {name: col.get(node.name) for name, col in columns.items()}
        if catalog_link:
            values["link_bps"] = catalog_link
        rows.append({"rank": node.rank, "node": node.name, "address": node.address, **values})
    jobs = prom.query("max by (job) (fsdp_trainer_tokens_per_second and on (job) "
                      f"(time() - max by (job) (fsdp_trainer_last_update_seconds) < {LIVE_S}))")
    return {"cluster": record.name, "time": time.time(), "nodes": rows,
            "jobs": {r["metric"].get("job", "?"): float(r["value"][1]) for r in jobs}}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _gib(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    return f"{used / 2**30:.1f}/{total / 2**30:.0f}G" if total else f"{used / 2**30:.1f}G"


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def render_view(view: dict[str, Any]) -> str:
    head = ("RANK", "NODE", "UP", "GPU", "GPU MEM", "CPU", "MEM", "RX Gb/s", "TX Gb/s", "LINK", "EFA RX",
            "EFA TX", "TOK/S")
    rows = []
    for r in view["nodes"]:
        link = r.get("link_bps")
        rows.append((str(r["rank"]), r["node"], "yes" if r.get("up") == 1 else "NO", _pct(r.get("gpu_util")),
                     _gib(r.get("gpu_mem_used_bytes"), r.get("gpu_mem_total_bytes")), _pct(r.get("cpu_util")),
                     _gib(r.get("mem_used_bytes"), r.get("mem_total_bytes")), _gbps(r.get("net_rx_bps")),
                     _gbps(r.get("net_tx_bps")), "-" if link is None else f"{link / 1e9:g}",
                     _gbps(r.get("efa_rx_bps")), _gbps(r.get("efa_tx_bps")),
                     "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in [head, *rows]]
    jobs = view.get("jobs") or {}
    lines.append("jobs: " + (", ".join(f"{job} {tps:,.0f} tok/s" for job, tps in sorted(jobs.items()))
                             if jobs else "no training job is exporting metrics"))
    return "\n".join(lines)


def cmd_monitor(args: Namespace) -> int:
    _state, record, spec = resolve_cluster(args.cluster)
    with Prometheus(record) as prom:
        while True:  # the nodes as the command read them at its start; Prometheus's figures each time
            view = node_view(record, spec, prom)
            if args.json:
                print_json(view)
            else:
                say(render_view(view))
            if args.once:
                return 0
            time.sleep(args.interval)
            if not args.json:
                say("")
