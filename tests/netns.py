"""Linux network namespaces for tests that run RACER's processes as separate hosts on one machine.

`Lan` builds one switched segment: a namespace ``<prefix>-lan`` holding a bridge, and one
namespace per host (``<prefix>-<host>``) whose ``eth0`` (a veth pair, the other end a bridge port
named after the host) has the address ``<subnet>.<n>/24``. The root namespace joins the segment
through the veth ``<prefix>-h`` (``<subnet>.1``), so the test process reaches every host over
its address; no namespace has a route anywhere else (no default route), and IPv6 is off on every
interface of the segment (no link-local or multicast chatter), so nothing leaves the segment.
``/etc/netns/<namespace>/hosts`` (bind-mounted over ``/etc/hosts`` by ``ip netns exec``) gives
each host the segment's names, as a cluster's DNS would.

A link is taken down on the switch's side (`Lan.set_link`): the host's own interface stays up,
as when a cable is pulled or a switch port fails, so its connections time out instead of failing
at once.

Everything the segment made carries the prefix; `cleanup` removes what a killed earlier run left
(its namespaces, the processes still in them, the root veth and the hosts files). Needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2's ``ip``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS``; RuntimeError with its stderr when it fails and ``check``."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable(prefix: str) -> str | None:
    """Why namespaces cannot be made here (None: they can): no ``ip``, or ``ip netns add`` refused."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install iproute2)"
    probe = f"{prefix}-probe"
    ip("netns", "del", probe, check=False)
    r = ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return (f"`ip netns add {probe}` failed as uid {os.getuid()} (exit {r.returncode}: "
                f"{(r.stderr or r.stdout).strip()}); network namespaces need root or CAP_SYS_ADMIN + CAP_NET_ADMIN")
    try:
        r = ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if r.returncode != 0:
            return f"`ip link add ... type veth` failed in a namespace: {(r.stderr or r.stdout).strip()}"
        r = ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"`ip link add ... type bridge` failed in a namespace: {(r.stderr or r.stdout).strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def namespaces(prefix: str) -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix + "-")]


def cleanup(prefix: str) -> None:
    """Remove everything named with ``prefix`` (a killed run's leftovers included): the processes
    in those namespaces (SIGKILL, by pid), the namespaces, the root veth, the hosts files."""
    for ns in namespaces(prefix):
        for pid in ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", ns, check=False)
    ip("link", "del", "dev", f"{prefix}-h", check=False)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.glob(f"{prefix}-*"):
            shutil.rmtree(d, ignore_errors=True)
        try:
            NETNS_ETC.rmdir()  # only when empty: another tool's files there stay
        except OSError:
            pass


def _no_ipv6(ns: str | None, iface: str = "") -> None:
    """IPv6 off in namespace ``ns`` (all and default), or on the root namespace's ``iface``."""
    targets = ["all", "default"] if ns is not None else [iface]
    cmd = "; ".join(f"[ ! -e /proc/sys/net/ipv6/conf/{t} ] || echo 1 > /proc/sys/net/ipv6/conf/{t}/disable_ipv6"
                    for t in targets)
    argv = ["sh", "-c", cmd] if ns is None else ["ip", "netns", "exec", ns, "sh", "-c", cmd]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


class Lan:
    """One segment ``<subnet>.0/24``: ``hosts`` maps a host's short name (at most 15 characters)
    to the last byte of its address; ``names`` maps DNS-like names to host short names (written
    to every host's ``/etc/hosts``)."""

    def __init__(self, prefix: str, hosts: dict[str, int], subnet: str = "10.77.0",
                 names: dict[str, str] | None = None):
        self.prefix, self.subnet, self.hosts = prefix, subnet, dict(hosts)
        self.names = dict(names or {})
        self.lan = f"{prefix}-lan"
        self.root_if = f"{prefix}-h"
        self.root_addr = f"{subnet}.1"

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def up(self) -> None:
        cleanup(self.prefix)
        taken = ip("-4", "-o", "addr", "show").stdout
        if f" {self.subnet}." in taken:
            raise RuntimeError(f"{self.subnet}.0/24 is already used on this machine:\n{taken}")
        ip("netns", "add", self.lan)
        _no_ipv6(self.lan)
        ip("-n", self.lan, "link", "add", "br0", "type", "bridge")
        ip("-n", self.lan, "link", "set", "dev", "br0", "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(
            f"{self.addr(h)} {name}\n" for name, h in self.names.items()) + "".join(
            f"{self.addr(h)} {self.ns(h)}\n" for h in self.hosts)
        for host in self.hosts:
            ns = self.ns(host)
            ip("netns", "add", ns)
            _no_ipv6(ns)
            ip("-n", ns, "link", "set", "dev", "lo", "up")
            ip("-n", self.lan, "link", "add", "name", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.lan, "link", "set", "dev", host, "master", "br0")
            ip("-n", self.lan, "link", "set", "dev", host, "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "dev", "eth0", "up")
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_text)
        # the root namespace's port: the test process talks to the hosts over the segment
        ip("link", "add", "name", self.root_if, "type", "veth", "peer", "name", "uplink", "netns", self.lan)
        _no_ipv6(None, self.root_if)
        ip("-n", self.lan, "link", "set", "dev", "uplink", "master", "br0")
        ip("-n", self.lan, "link", "set", "dev", "uplink", "up")
        ip("addr", "add", f"{self.root_addr}/24", "dev", self.root_if)
        ip("link", "set", "dev", self.root_if, "up")

    def set_link(self, host: str, up: bool) -> None:
        """Plug (``up``) or pull ``host``'s cable: its port on the switch."""
        ip("-n", self.lan, "link", "set", "dev", host, "up" if up else "down")

    def down(self) -> None:
        cleanup(self.prefix)
