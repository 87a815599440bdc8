#!/usr/bin/env python
"""Per-node network emulation on one machine: every emulated node has its own link.

Layout (``PREFIX`` = ``hvdnet<pid>-``; everything below lives in network namespaces
created here and is removed on exit, also on errors, SIGTERM and Ctrl-C)::

    PREFIX-br   bridge br0, one port p<k> per node; tbf on p<k>'s egress = node k's
                download direction
    PREFIX-n<k> node k: eth0 (veth to p<k>), 10.213.0.<k>/24, tbf on eth0's egress =
                node k's upload direction; lo; hostname node<k>
    PREFIX-ctl  the launcher (horovodrun and its rendezvous server): eth0 (veth to
                pctl), 10.213.0.254/24, unshaped

So each node has a full-duplex link of ``rate`` in each direction (``tc qdisc add ...
tbf rate RATE burst BURST latency LATENCY`` on both ends of its veth; netem is not
available here), and node-to-node traffic crosses two shaped hops (sender's upload,
receiver's download), as through a switch. Ranks on the same node talk over that
node's loopback, unshaped, as on a real node. The private subnet (default
10.213.0.0/24) exists only inside these namespaces: nothing is added to the root
namespace, and no traffic leaves them.

Launching with an unmodified ``horovodrun -np P -H node1:s,...,nodeN:s``: horovodrun
runs in ``PREFIX-ctl`` and reaches every node through ``ssh``; a generated ``ssh`` shim,
first on PATH, runs the command in that node's namespace (``ip netns exec``) inside a
fresh UTS namespace whose hostname is ``node<k>`` (``unshare --uts``). Both are needed
because Horovod 0.28.1 builds its Gloo device from ``gethostname()`` (it ignores
``HOROVOD_GLOO_IFACE`` for that): every node needs its own hostname and a hosts file
resolving all nodes (``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
bind-mounts over ``/etc/hosts``); otherwise workers segfault or abort with "Unable to
find address".

Horovod's torch binding waits for a collective by spinning on ``sched_yield()``; with
more ranks than cores the waiting ranks steal CPU from the ones still working.
:func:`build_yield_shim` compiles (gcc) an ``LD_PRELOAD`` library that turns
``sched_yield`` into a short ``nanosleep`` (``HVDNET_YIELD_SLEEP_US``, default 50 us).

torchrun jobs: :meth:`PerNodeNetwork.torchrun_cmds` / :func:`run_torchrun` start one
``torchrun --nnodes N --node-rank k-1 --master-addr <node1> ...`` agent per node, each
in its node's namespace under its hostname, Gloo on ``eth0`` (``GLOO_SOCKET_IFNAME``);
:func:`torch_allreduce_check` validates that path against the ring model. Gloo's
collectives in torch wait on a condition variable, not a ``sched_yield`` spin, so the
shim below is not needed there (scripts/bench_ddp.py reports each rank's CPU time per
step, which shows it).

Time dilation: P ranks on C < P cores run C/P as fast as P nodes with a CPU each, so a
link of ``rate * C / P`` keeps the compute-to-network ratio of the real cluster
(:func:`dilated_rate`).

Command line::

    python scripts/netemu.py run --nodes 4 --rate 1gbit -- \\
        horovodrun -np 4 -H node1:1,node2:1,node3:1,node4:1 python train.py
    python scripts/netemu.py validate --nodes 4 --rate 500mbit   # p2p + allreduce vs model
    python scripts/netemu.py validate --nodes 4 --rate 500mbit --launchers both
    python scripts/netemu.py cleanup                              # stale namespaces

Needs root, ``ip``/``tc`` (iproute2), ``unshare`` (util-linux); gcc for the yield shim.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME_BASE = "hvdnet"
NETNS_ETC = Path("/etc/netns")
IFACE = "eth0"


# ----------------------------------------------------------------------------- rates

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(rate: str) -> float:
    """tc rate string -> bits per second (tc's units: kbit = 1000 bit, mbps = 8e6 bit)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", str(rate))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of {sorted(_UNITS)}")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def format_rate(bits_per_s: float) -> str:
    """bits per second -> a tc rate string (whole gbit / mbit / kbit, which tc accepts)."""
    kbit = int(round(bits_per_s / 1e3))
    for unit, scale in (("gbit", 10**6), ("mbit", 10**3)):
        if kbit % scale == 0:
            return f"{kbit // scale}{unit}"
    return f"{kbit}kbit"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def dilated_rate(rate: str, ranks: int, cores: int | None = None) -> str:
    """``rate * min(1, cores / ranks)``: with P ranks sharing C < P cores every CPU-side
    cost is P/C times longer than on P nodes with a CPU each, so slowing the link by the
    same factor keeps the compute-to-network ratio of the real cluster."""
    cores = usable_cores() if cores is None else cores
    return format_rate(parse_rate(rate) * min(1.0, cores / max(1, ranks)))


def ring_allreduce_seconds(nbytes: int, ranks: int, rate: str) -> float:
    """Bandwidth term of a ring allreduce: each rank sends and receives
    2 (P-1)/P x size over its own link (latency ignored)."""
    return 2 * (ranks - 1) / ranks * nbytes * 8 / parse_rate(rate) if ranks > 1 else 0.0


# ----------------------------------------------------------------------------- helpers

def _run(*cmd, check=True, capture=True):
    r = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.STDOUT if capture else None, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={r.returncode}): "
                           f"{(r.stdout or '').strip()}")
    return r.stdout or ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_pids(ns: str):
    """SIGKILL every process still inside namespace ``ns`` (processes this tool started
    there: horovodrun, its workers, validation helpers)."""
    out = _run("ip", "netns", "pids", ns, check=False)
    for tok in out.split():
        if tok.isdigit() and int(tok) != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(tok), signal.SIGKILL)


def _delete_namespace(ns: str):
    _kill_namespace_pids(ns)
    _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def cleanup_stale(verbose=True) -> list[str]:
    """Delete namespaces named ``hvdnet<pid>-*`` whose creating process is gone (left by
    a run that was killed with SIGKILL), with their /etc/netns entries."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{NAME_BASE}(\d+)-.*", ns)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            m = re.fullmatch(rf"{NAME_BASE}(\d+)-.*", d.name)
            if m and not _pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)
    if removed and verbose:
        print(f"[netemu] removed stale namespaces: {' '.join(removed)}", flush=True)
    return removed


def check_environment(need_gcc=False) -> list[str]:
    problems = []
    if os.geteuid() != 0:
        problems.append("not running as root (network namespaces and tc need root)")
    for tool in ("ip", "tc", "unshare") + (("gcc",) if need_gcc else ()):
        if shutil.which(tool) is None:
            problems.append(f"'{tool}' not found")
    return problems


# ----------------------------------------------------------------------------- yield shim

YIELD_SHIM_C = r"""
/* LD_PRELOAD: sched_yield() -> nanosleep(HVDNET_YIELD_SLEEP_US, default 50 us).
 * Horovod's torch binding waits for a collective in a loop around sched_yield; with
 * more ranks than cores that spin takes CPU from ranks that still compute. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <time.h>
static struct timespec hvdnet_ts = {0, 50000};
__attribute__((constructor)) static void hvdnet_init(void) {
    const char *s = getenv("HVDNET_YIELD_SLEEP_US");
    if (s && *s) {
        long us = atol(s);
        if (us >= 0) { hvdnet_ts.tv_sec = us / 1000000; hvdnet_ts.tv_nsec = (us % 1000000) * 1000; }
    }
}
int sched_yield(void) { nanosleep(&hvdnet_ts, 0); return 0; }
"""


def build_yield_shim(workdir) -> str:
    """Compile the sched_yield -> nanosleep shim with gcc; returns the .so path."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src, lib = workdir / "yield_sleep.c", workdir / "libyield_sleep.so"
    src.write_text(YIELD_SHIM_C)
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc not found: cannot build the sched_yield shim "
                           "(pass --yield-shim off)")
    _run("gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src))
    return str(lib)


# ----------------------------------------------------------------------------- network

SSH_SHIM = """#!/bin/sh
# ssh shim generated by scripts/netemu.py: run the command in the emulated node's network
# namespace, in a fresh UTS namespace whose hostname is the node's name.
# like OpenSSH, options may come before and after the host (horovodrun puts
# "-o ConnectTimeout=..." after it); the first word after the host that is not an
# option starts the command
host=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l|-F|-E|-J|-c|-m|-b|-e) shift 2 ;;
    --) shift; [ -n "$host" ] || {{ host="$1"; shift; }}; break ;;
    -*) shift ;;
    *) if [ -z "$host" ]; then host="$1"; shift; else break; fi ;;
  esac
done
case "$host" in
{cases}
  *) echo "netemu ssh shim: unknown host '$host'" >&2; exit 255 ;;
esac
cmd="$*"
[ -n "$cmd" ] || {{ echo "netemu ssh shim: no command (interactive ssh is not emulated)" >&2; exit 255; }}
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$1" && exec sh -c "$2"' sh "$host" "$cmd"
"""


class PerNodeNetwork:
    """``nodes`` namespaces with their own shaped link each, a bridge, a launcher.

    Use as a context manager; :meth:`launcher_cmd` prefixes a command so it runs in the
    launcher namespace with the ssh shim first on PATH, :meth:`node_cmd` runs one in a
    node's namespace (with its hostname)."""

    def __init__(self, nodes: int, rate: str, burst="256kb", latency="50ms",
                 subnet="10.213.0", workdir=None):
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be in [1, 250], got {nodes}")
        parse_rate(rate)
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"subnet {subnet!r}: expected the first three octets of a "
                             f"private 10.x.y.0/24, e.g. 10.213.0")
        self.nodes, self.rate, self.burst, self.latency = nodes, rate, burst, latency
        self.subnet = subnet
        self.prefix = f"{NAME_BASE}{os.getpid()}-"
        self.bridge_ns, self.ctl_ns = self.prefix + "br", self.prefix + "ctl"
        self.node_ns = [f"{self.prefix}n{k}" for k in range(1, nodes + 1)]
        self.hostnames = [f"node{k}" for k in range(1, nodes + 1)]
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hvdnet"))
        self.bindir = self.workdir / "bin"
        self.created: list[str] = []

    # addresses
    def address(self, k: int) -> str:
        """IPv4 address of node k (1-based)."""
        return f"{self.subnet}.{k}"

    @property
    def launcher_address(self) -> str:
        return f"{self.subnet}.254"

    def hosts_arg(self, slots: int = 1) -> str:
        """horovodrun -H value: node1:slots,...,nodeN:slots."""
        return ",".join(f"{h}:{slots}" for h in self.hostnames)

    # set-up / tear-down
    def _ns(self, ns, *cmd):
        return _run("ip", "netns", "exec", ns, *cmd)

    def _add_ns(self, ns):
        _run("ip", "netns", "add", ns)
        self.created.append(ns)
        self._ns(ns, "ip", "link", "set", "lo", "up")

    def _tbf(self, ns, dev):
        self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                 "burst", self.burst, "latency", self.latency)

    def __enter__(self):
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _setup(self):
        self._add_ns(self.bridge_ns)
        self._ns(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.bridge_ns, "ip", "link", "set", "br0", "up")
        hosts = ["127.0.0.1 localhost"] + \
            [f"{self.address(k)} {h}" for k, h in enumerate(self.hostnames, 1)] + \
            [f"{self.launcher_address} launcher"]
        ends = [(ns, f"p{k}", self.address(k), True)
                for k, ns in enumerate(self.node_ns, 1)]
        ends.append((self.ctl_ns, "pctl", self.launcher_address, False))
        for ns, port, addr, shaped in ends:
            self._add_ns(ns)
            # the veth is created inside the node namespace with its peer directly in the
            # bridge namespace: no interface ever appears in the root namespace
            self._ns(ns, "ip", "link", "add", IFACE, "type", "veth", "peer", "name", port,
                     "netns", self.bridge_ns)
            self._ns(self.bridge_ns, "ip", "link", "set", port, "master", "br0")
            self._ns(self.bridge_ns, "ip", "link", "set", port, "up")
            self._ns(ns, "ip", "addr", "add", f"{addr}/24", "dev", IFACE)
            self._ns(ns, "ip", "link", "set", IFACE, "up")
            if shaped:
                self._tbf(ns, IFACE)                 # upload
                self._tbf(self.bridge_ns, port)      # download
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
        self.bindir.mkdir(parents=True, exist_ok=True)
        cases = "\n".join(f"  {h}) ns={ns} ;;" for h, ns in zip(self.hostnames, self.node_ns))
        shim = self.bindir / "ssh"
        shim.write_text(SSH_SHIM.format(cases=cases))
        shim.chmod(0o755)

    def close(self):
        for ns in reversed(self.created):
            _delete_namespace(ns)
        self.created = []
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *exc):
        self.close()
        return False

    def kill_all(self):
        """SIGKILL whatever still runs in the nodes / launcher (after a failed run)."""
        for ns in self.node_ns + [self.ctl_ns]:
            _kill_namespace_pids(ns)

    # commands
    def env(self, base=None) -> dict:
        """Environment for a launcher command: the ssh shim first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join([str(self.bindir), env.get("PATH", "")])
        return env

    def launcher_cmd(self, cmd) -> list[str]:
        return ["ip", "netns", "exec", self.ctl_ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname launcher && exec "$@"', "sh", *cmd]

    def node_cmd(self, k: int, cmd) -> list[str]:
        """Run ``cmd`` on node k (1-based) with its hostname."""
        return ["ip", "netns", "exec", self.node_ns[k - 1], "unshare", "--uts", "--", "sh",
                "-c", f'hostname {self.hostnames[k - 1]} && exec "$@"', "sh", *cmd]

    def torchrun_cmds(self, script, nodes=None, nproc_per_node=1, master_port=29400,
                      torchrun=None) -> list[list[str]]:
        """One ``torchrun --nnodes N --nproc-per-node S --node-rank k-1 --master-addr
        <node1> --master-port PORT script...`` per emulated node k, each run inside node
        k's namespace under its hostname (:meth:`node_cmd`): a multi-node torchrun job,
        static rendezvous on node 1's ``eth0`` address. ``script``: the script path and
        its arguments (torchrun runs it with this python). Run them together with
        :func:`run_torchrun`; set ``GLOO_SOCKET_IFNAME=eth0`` (it does) so Gloo's pairs
        use the shaped link."""
        nodes = self.nodes if nodes is None else nodes
        if not 1 <= nodes <= self.nodes:
            raise ValueError(f"torchrun over {nodes} nodes: the network has {self.nodes}")
        exe = torchrun or torchrun_exe()
        return [self.node_cmd(k, [exe, "--nnodes", str(nodes), "--nproc-per-node",
                                  str(nproc_per_node), "--node-rank", str(k - 1),
                                  "--rdzv-backend", "static", "--master-addr", self.address(1),
                                  "--master-port", str(master_port), "--max-restarts", "0",
                                  *[str(x) for x in script]])
                for k in range(1, nodes + 1)]

    def port_counters(self) -> dict:
        """Bridge-side (rx, tx) byte counters per node: rx = what node k sent,
        tx = what node k received."""
        out = self._ns(self.bridge_ns, "cat", "/proc/net/dev")
        res = {}
        for line in out.splitlines():
            name, _, rest = line.partition(":")
            name = name.strip()
            if re.fullmatch(r"p\d+", name):
                f = rest.split()
                res[int(name[1:])] = (int(f[0]), int(f[8]))
        return res

    def qdisc_stats(self) -> str:
        lines = []
        for k, ns in enumerate(self.node_ns, 1):
            up = self._ns(ns, "tc", "-s", "qdisc", "show", "dev", IFACE).strip()
            down = self._ns(self.bridge_ns, "tc", "-s", "qdisc", "show", "dev", f"p{k}").strip()
            lines.append(f"node{k} upload ({IFACE}): {' '.join(up.split())}")
            lines.append(f"node{k} download (p{k}): {' '.join(down.split())}")
        return "\n".join(lines)

    def describe(self) -> str:
        return (f"{self.nodes} emulated nodes ({self.prefix}n1..n{self.nodes}), each with its "
                f"own full-duplex link: tbf rate {self.rate} burst {self.burst} latency "
                f"{self.latency} on both ends of its veth, joined by bridge {self.bridge_ns}; "
                f"launcher {self.ctl_ns}; subnet {self.subnet}.0/24 inside the namespaces only")


# ----------------------------------------------------------------------------- validation

def _sink(port: int, bind: str):
    """Receive one connection's bytes and answer with the count (helper process)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((bind, port))
    s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    n = 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        n += len(d)
    c.sendall(str(n).encode())
    c.close()


def _source(host: str, port: int, nbytes: int, start_at: float = 0.0):
    """Send nbytes (from wall-clock time ``start_at``, so both directions of a duplex
    test start together), wait for the receiver's count; prints JSON with the seconds
    taken."""
    for _ in range(100):
        try:
            s = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            time.sleep(0.05)
    else:
        raise SystemExit(f"cannot connect to {host}:{port}")
    buf = b"\0" * (1 << 20)
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        left -= s.send(buf[:min(left, len(buf))])
    s.shutdown(socket.SHUT_WR)
    got = int(s.recv(64).decode() or 0)
    dt = time.perf_counter() - t0
    print(json.dumps({"bytes": nbytes, "received": got, "seconds": dt}), flush=True)


def point_to_point(net: PerNodeNetwork, nbytes: int, duplex=False, port=5301) -> dict:
    """node1 -> node2 (and node2 -> node1 at the same time when ``duplex``): seconds and
    achieved rate per direction vs ``nbytes * 8 / rate``."""
    if net.nodes < 2:
        raise ValueError("point-to-point needs at least 2 nodes")
    py = sys.executable
    pairs = [(1, 2)] + ([(2, 1)] if duplex else [])
    sinks, sources = [], []
    try:
        for i, (a, b) in enumerate(pairs):
            p = subprocess.Popen(net.node_cmd(b, [py, __file__, "_sink", str(port + i),
                                                   net.address(b)]),
                                 stdout=subprocess.PIPE, text=True)
            sinks.append(p)
            assert p.stdout.readline().strip() == "ready"
        start_at = time.time() + 2.0          # both directions start at the same moment
        for i, (a, b) in enumerate(pairs):
            sources.append(subprocess.Popen(
                net.node_cmd(a, [py, __file__, "_source", net.address(b), str(port + i),
                                 str(nbytes), repr(start_at)]), stdout=subprocess.PIPE,
                text=True))
        results = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])
                   for p in sources]
    finally:
        for p in sinks + sources:
            if p.poll() is None:
                p.kill()
            p.wait()
    model = nbytes * 8 / parse_rate(net.rate)
    out = {"bytes": nbytes, "rate": net.rate, "duplex": duplex, "model_s": model,
           "directions": []}
    for (a, b), r in zip(pairs, results):
        if r["received"] != nbytes:
            raise RuntimeError(f"point-to-point node{a}->node{b}: sent {nbytes} bytes, "
                               f"receiver counted {r['received']}")
        out["directions"].append({"from": f"node{a}", "to": f"node{b}", "seconds": r["seconds"],
                                  "mbit_s": nbytes * 8 / r["seconds"] / 1e6,
                                  "measured_over_model": r["seconds"] / model})
    return out


def _allreduce_worker(mb: float, reps: int, out: str):
    """Run under horovodrun: dense fp32 allreduce of ``mb`` MB, ``reps`` timed reps."""
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    n = int(mb * 1e6 / 4)
    x = torch.ones(n)
    hvd.allreduce(x, name="warm")
    times = []
    for i in range(reps):
        hvd.allreduce(torch.zeros(1), name=f"bar{i}")       # start together
        t0 = time.perf_counter()
        hvd.allreduce(x, name=f"ar{i}")
        times.append(time.perf_counter() - t0)
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="max")
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": hvd.size(), "bytes": n * 4, "times_s": slowest.tolist(),
                       "hostname": socket.gethostname()}, f)
    print(f"HVDSPARSE-OK rank={hvd.rank()}", flush=True)


def horovodrun_exe() -> str:
    exe = Path(sys.executable).with_name("horovodrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("horovodrun")
    if not found:
        raise SystemExit("horovodrun not found next to this python nor on PATH")
    return found


def torchrun_exe() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("torchrun")
    if not found:
        raise SystemExit("torchrun not found next to this python nor on PATH")
    return found


def run_torchrun(net: PerNodeNetwork, script, nodes=None, nproc_per_node=1, env=None,
                 master_port=None, timeout=900, log=None) -> int:
    """Launch ``script`` (path + arguments) as one torchrun job over ``nodes`` emulated
    nodes (default all), one torchrun agent per node started in that node's namespace;
    waits for all of them. Returns 0 when every agent exited 0, else the first non-zero
    return code (or 124 on timeout); on failure every process left in the nodes is
    killed, so a dead rank never leaves the others hanging in a collective. ``env``: the
    agents' environment (default os.environ) plus ``GLOO_SOCKET_IFNAME=eth0`` and
    ``OMP_NUM_THREADS=1`` unless set; ``log``: a file collecting every agent's output,
    prefixed per node."""
    nodes = net.nodes if nodes is None else nodes
    env = dict(os.environ if env is None else env)
    env.setdefault("GLOO_SOCKET_IFNAME", IFACE)
    env.setdefault("OMP_NUM_THREADS", "1")
    if master_port is None:
        master_port = 29400 + os.getpid() % 1000      # private namespaces: any port is free
    cmds = net.torchrun_cmds(script, nodes, nproc_per_node, master_port)
    logf = open(log, "w") if log else None
    procs, rc = [], None
    try:
        if logf:
            logf.write("".join("$ " + shlex.join(c) + "\n" for c in cmds))
            logf.flush()
        for c in cmds:
            procs.append(subprocess.Popen(c, env=env, cwd=str(ROOT), stdout=logf or None,
                                          stderr=subprocess.STDOUT if logf else None))
        deadline = time.time() + timeout
        while rc is None:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad:
                rc = bad[0]                     # one agent failed: stop the others
            elif all(c == 0 for c in codes):
                rc = 0
            elif time.time() > deadline:
                rc = 124
            else:
                time.sleep(0.2)
    finally:
        if rc != 0:
            net.kill_all()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if logf:
            logf.close()
    return rc


def _torch_allreduce_worker(mb: float, reps: int, out: str):
    """Run under torchrun: dense fp32 ``torch.distributed.all_reduce`` (Gloo) of ``mb``
    MB, ``reps`` timed reps, slowest rank per rep."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = int(mb * 1e6 / 4)
    x = torch.ones(n)
    dist.all_reduce(x)
    times = []
    for _ in range(reps):
        dist.barrier()                                       # start together
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    # the sum of ones over P ranks, reps + 1 times: P ** (reps + 1) exactly
    ok = bool((x == float(dist.get_world_size()) ** (reps + 1)).all())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": dist.get_world_size(), "bytes": n * 4,
                       "times_s": slowest.tolist(), "sum_ok": ok,
                       "hostname": socket.gethostname()}, f)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("torch allreduce: wrong sum")


def torch_allreduce_check(net: PerNodeNetwork, ranks: int, mb: float, reps=5, timeout=300,
                          log=None) -> dict:
    """Dense Gloo allreduce under torchrun over ``ranks`` emulated nodes (one rank per
    node, :func:`run_torchrun`) vs the ring model 2 (P-1)/P x size / rate."""
    if ranks > net.nodes:
        raise ValueError(f"{ranks} ranks need {ranks} nodes, the network has {net.nodes}")
    with tempfile.TemporaryDirectory(prefix="hvdnet-tar") as td:
        out = Path(td) / "ar.json"
        logf = log or Path(td) / "torchrun.log"
        rc = run_torchrun(net, [__file__, "_torch_allreduce", mb, reps, out], nodes=ranks,
                          timeout=timeout, log=logf)
        if rc != 0 or not out.exists():
            raise RuntimeError(f"torchrun allreduce check failed (rc={rc}):\n"
                               f"{Path(logf).read_text()[-3000:]}")
        res = json.loads(out.read_text())
    model = ring_allreduce_seconds(res["bytes"], ranks, net.rate)
    med = statistics.median(res["times_s"])
    res.update(rate=net.rate, model_s=model, median_s=med, measured_over_model=med / model,
               yield_shim=False, launcher="torchrun")
    return res


def allreduce_check(net: PerNodeNetwork, ranks: int, mb: float, reps=5, yield_shim=None,
                    timeout=300, log=None) -> dict:
    """Dense allreduce under horovodrun on the emulated nodes (one rank per node) vs the
    ring model 2 (P-1)/P x size / rate; ``yield_shim``: path of the LD_PRELOAD library."""
    if ranks > net.nodes:
        raise ValueError(f"{ranks} ranks need {ranks} nodes, the network has {net.nodes}")
    with tempfile.TemporaryDirectory(prefix="hvdnet-ar") as td:
        out = Path(td) / "ar.json"
        hosts = ",".join(f"{h}:1" for h in net.hostnames[:ranks])
        cmd = net.launcher_cmd([horovodrun_exe(), "-np", str(ranks), "-H", hosts, "--gloo",
                                sys.executable, __file__, "_allreduce", str(mb), str(reps),
                                str(out)])
        env = net.env()
        env["OMP_NUM_THREADS"] = "1"
        env.pop("LD_PRELOAD", None)
        if yield_shim:
            env["LD_PRELOAD"] = yield_shim
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=str(ROOT), timeout=timeout)
        if log is not None:
            Path(log).write_text("$ " + shlex.join(cmd) + "\n" + r.stdout)
        if r.returncode != 0 or not out.exists():
            net.kill_all()
            raise RuntimeError(f"allreduce check failed (rc={r.returncode}):\n{r.stdout[-3000:]}")
        res = json.loads(out.read_text())
    model = ring_allreduce_seconds(res["bytes"], ranks, net.rate)
    med = statistics.median(res["times_s"])
    res.update(rate=net.rate, model_s=model, median_s=med, measured_over_model=med / model,
               yield_shim=bool(yield_shim))
    return res


def validation_table(rows) -> str:
    md = ["| check | link rate | size | yield shim | measured (s) | model (s) | measured / model |",
          "|---|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if r["kind"] == "p2p":
            for d in r["directions"]:
                md.append(f"| point-to-point {d['from']}->{d['to']}"
                          f"{' (both directions at once)' if r['duplex'] else ''} | {r['rate']} "
                          f"| {r['bytes'] / 1e6:.0f} MB | - | {d['seconds']:.3f} "
                          f"| {r['model_s']:.3f} | {d['measured_over_model']:.2f} |")
        else:
            who = "torchrun (Gloo)" if r.get("launcher") == "torchrun" else "horovodrun"
            md.append(f"| dense allreduce, {who}, P={r['ranks']} (median of {len(r['times_s'])}) "
                      f"| {r['rate']} | {r['bytes'] / 1e6:.1f} MB "
                      f"| {'on' if r['yield_shim'] else 'off'} | {r['median_s']:.3f} "
                      f"| {r['model_s']:.3f} | {r['measured_over_model']:.2f} |")
    return "\n".join(md)


def validate(net: PerNodeNetwork, ranks: int, p2p_mb=25.0, ar_mb=16.0, reps=5,
             shims=(None,), logdir=None, horovod=True, torchrun=False) -> list[dict]:
    """Point-to-point (one way, then both ways at once) and dense allreduce vs model:
    under horovodrun (``horovod``: once per entry of ``shims``) and/or under torchrun
    (``torchrun``: Gloo via torch.distributed, :func:`torch_allreduce_check`)."""
    rows = []
    if torchrun:
        log = Path(logdir) / f"torch_allreduce_{net.rate}.log" if logdir else None
        r = torch_allreduce_check(net, ranks, ar_mb, reps=reps, log=log)
        r["kind"] = "allreduce"
        rows.append(r)
    if not horovod:
        shims = ()
    if net.nodes >= 2:
        for duplex in (False, True):
            r = point_to_point(net, int(p2p_mb * 1e6), duplex=duplex)
            r["kind"] = "p2p"
            rows.append(r)
    for shim in shims:
        log = None
        if logdir:
            log = Path(logdir) / f"allreduce_{net.rate}_{'shim' if shim else 'noshim'}.log"
        r = allreduce_check(net, ranks, ar_mb, reps=reps, yield_shim=shim, log=log)
        r["kind"] = "allreduce"
        rows.append(r)
    return rows


# ----------------------------------------------------------------------------- CLI

def _install_signal_handlers():
    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_sink":
        return _sink(int(argv[1]), argv[2])
    if argv and argv[0] == "_source":
        return _source(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
    if argv and argv[0] == "_allreduce":
        return _allreduce_worker(float(argv[1]), int(argv[2]), argv[3])
    if argv and argv[0] == "_torch_allreduce":
        return _torch_allreduce_worker(float(argv[1]), int(argv[2]), argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "validate"):
        s = sub.add_parser(name)
        s.add_argument("--nodes", type=int, default=4)
        s.add_argument("--rate", default="1gbit")
        s.add_argument("--burst", default="256kb")
        s.add_argument("--latency", default="50ms")
        s.add_argument("--dilate", type=int, default=0, metavar="RANKS",
                       help="scale the rate by cores/RANKS (time dilation)")
        s.add_argument("--yield-shim", choices=("on", "off", "both"), default="on")
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER)
    sub.choices["validate"].add_argument("--ranks", type=int, default=None)
    sub.choices["validate"].add_argument("--ar-mb", type=float, default=16.0)
    sub.choices["validate"].add_argument("--p2p-mb", type=float, default=25.0)
    sub.choices["validate"].add_argument("--launchers", default="horovodrun",
                                         help="horovodrun, torchrun or both")
    sub.add_parser("cleanup")
    a = p.parse_args(argv)
    if a.cmd == "cleanup":
        cleanup_stale()
        return 0
    problems = check_environment(need_gcc=a.yield_shim != "off")
    if problems:
        raise SystemExit("cannot emulate the network: " + "; ".join(problems))
    _install_signal_handlers()
    cleanup_stale()
    rate = dilated_rate(a.rate, a.dilate) if a.dilate else a.rate
    with PerNodeNetwork(a.nodes, rate, a.burst, a.latency) as net:
        print(f"[netemu] {net.describe()}", flush=True)
        shims = {"on": [build_yield_shim(net.workdir)], "off": [None]}.get(a.yield_shim)
        if shims is None:
            shims = [None, build_yield_shim(net.workdir)]
        if a.cmd == "validate":
            rows = validate(net, a.ranks or a.nodes, a.p2p_mb, a.ar_mb, shims=shims,
                            horovod=a.launchers in ("horovodrun", "both"),
                            torchrun=a.launchers in ("torchrun", "both"))
            print(validation_table(rows))
            return 0
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        if not cmd:
            raise SystemExit("run: give a command after --")
        env = net.env()
        if shims[-1]:
            env["LD_PRELOAD"] = shims[-1]
        return subprocess.call(net.launcher_cmd(cmd), env=env)


if __name__ == "__main__":
    sys.exit(main())
