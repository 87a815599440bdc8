"""scripts/netemu.py: the per-node network emulation behind bench_network.py.

Pure functions (rate parsing, time dilation, ring model) always; the real emulation
(network namespaces, veth + bridge, tbf both ways, the ssh shim) only as root with
``ip``, ``tc`` and ``unshare`` (skipped otherwise). The namespace test takes ~2-4 s.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import netemu  # noqa: E402


def test_rates_dilation_and_ring_model():
    assert netemu.parse_rate("1gbit") == 1e9
    assert netemu.parse_rate("500mbit") == 5e8
    assert netemu.parse_rate("10mbps") == 8e7
    with pytest.raises(ValueError, match="rate"):
        netemu.parse_rate("fast")
    # 4 ranks on 2 cores see half the link; never faster than the raw link
    assert netemu.dilated_rate("1gbit", 4, cores=2) == "500mbit"
    assert netemu.dilated_rate("1gbit", 3, cores=2) == "666667kbit"
    assert netemu.parse_rate(netemu.dilated_rate("1gbit", 16, cores=2)) == 1.25e8
    assert netemu.parse_rate(netemu.dilated_rate("1gbit", 2, cores=8)) == 1e9
    # ring allreduce: 2 (P-1)/P x size / rate
    assert netemu.ring_allreduce_seconds(10**8, 4, "1gbit") == pytest.approx(1.2)
    assert netemu.ring_allreduce_seconds(10**8, 1, "1gbit") == 0.0


needs_root = pytest.mark.skipif(
    bool(netemu.check_environment()),
    reason="needs root, ip, tc and unshare: " + "; ".join(netemu.check_environment()))


@needs_root
def test_per_node_network_shim_hostnames_shaping_cleanup():
    with netemu.PerNodeNetwork(2, "100mbit") as net:
        names = set(net.created)
        assert names <= set(netemu.list_namespaces())
        env = net.env()

        def launcher(script):
            r = subprocess.run(net.launcher_cmd(["sh", "-c", script]), env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
            assert r.returncode == 0, r.stdout
            return r.stdout.split()

        # horovodrun's forms: options before and after the host, command as one word
        out = launcher("ssh -o PasswordAuthentication=no -o StrictHostKeyChecking=no node2 "
                       "-o ConnectTimeout=10 'hostname; getent hosts node1 node2'")
        assert out == ["node2", "10.213.0.1", "node1", "10.213.0.2", "node2"], out
        assert launcher("hostname; ssh node1 hostname") == ["launcher", "node1"]
        bad = subprocess.run(net.launcher_cmd(["ssh", "node9", "true"]), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert bad.returncode == 255 and "unknown host 'node9'" in bad.stdout
        # tbf on both ends of every node's link
        q = net.qdisc_stats()
        assert q.count("tbf") == 4 and q.count("100Mbit") == 4, q
        # the subnet exists only inside the namespaces
        root = subprocess.run(["ip", "-4", "addr"], stdout=subprocess.PIPE, text=True).stdout
        assert net.subnet not in root
        # shaping works: 2 MB at 100 Mbit/s cannot take less than ~0.16 s
        r = netemu.point_to_point(net, 2_000_000)
        d = r["directions"][0]
        assert 0.9 <= d["measured_over_model"] < 20, r
    assert not names & set(netemu.list_namespaces()), "namespaces left behind"
    assert not any((netemu.NETNS_ETC / n).exists() for n in names)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_yield_shim_replaces_sched_yield(tmp_path):
    lib = netemu.build_yield_shim(tmp_path)
    code = ("import os, time; t = time.perf_counter(); [os.sched_yield() for _ in range(200)]; "
            "print(time.perf_counter() - t)")
    env = dict(os.environ, LD_PRELOAD=lib, HVDNET_YIELD_SLEEP_US="1000")
    slow = float(subprocess.run([sys.executable, "-c", code], env=env, text=True,
                                stdout=subprocess.PIPE, check=True).stdout)
    # 200 yields turned into >= 1 ms sleeps each: at least 0.2 s
    assert slow >= 0.2, slow


@needs_root
def test_torchrun_launcher_across_emulated_nodes():
    """One torchrun agent per node, Gloo over the shaped eth0: the allreduce sums
    correctly (checked in the worker against P ** (reps + 1)) and cannot beat the link."""
    with netemu.PerNodeNetwork(2, "100mbit") as net:
        cmds = net.torchrun_cmds(["x.py"], master_port=29555)
        assert [c[c.index("--node-rank") + 1] for c in cmds] == ["0", "1"]
        assert all(c[c.index("--master-addr") + 1] == net.address(1) for c in cmds)
        r = netemu.torch_allreduce_check(net, 2, 1.0, reps=2)
        assert r["sum_ok"] and r["ranks"] == 2, r
        # 1 MB ring allreduce at 100 Mbit/s: >= 0.08 s unless the link is not shaped
        assert 0.9 <= r["measured_over_model"] < 20, r
