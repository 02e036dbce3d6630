"""SimulatedHosts: several "hosts" on one Linux machine, for multi-host tests and the bench.

Each host is a network namespace with its own address on one bridge (a veth pair per
host), its own hostname, its own ``/etc/hosts`` (where its hostname resolves to
loopback, as on a Debian default install: nothing may rely on hostname resolution),
and its own ``/dev/shm`` (a tmpfs of its own, bind-mounted over ``/dev/shm`` in every
process started there). Processes run with ``Host.command(argv)``: the argv wrapped in
``ip netns exec`` and ``unshare``, exec'ing all the way down, so the process started
is the program itself and stopping it stops the program.

Needs root (``ip netns``, ``mount``). ``unavailable_reason()`` says why it cannot run
here. On exit every process started through ``Host.spawn`` is stopped and every
namespace, link, mount and folder made is removed, whatever happened in between. A
process killed outright (SIGKILL: a test's timeout, the OOM killer) cannot do that: its
folder names its owner, and the next ``SimulatedHosts`` removes what an owner that is
gone left (its hosts' /dev/shm mounts hold RAM).
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from weightsync.lifecycle import spawn, stop_process

_WRAP = 'mount --bind "$0" /dev/shm && hostname "$1" && shift 1 && exec "$@"'


def unavailable_reason() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, mounts)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"wsprobe{os.getpid() % 100000}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass
class Host:
    """One simulated host: ``address`` is its IP on the bridge; ``link`` the bridge side
    of its veth (its counters are this host's traffic, seen from the network)."""

    name: str
    netns: str
    address: str
    hostname: str
    shm_dir: str
    link: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this host (its network, hostname and /dev/shm)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--uts", "--propagation", "private",
                "sh", "-c", _WRAP, self.shm_dir, self.hostname, *argv]

    def spawn(self, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` on this host; it is stopped when the hosts are torn down."""
        proc = spawn(self.command(argv), **popen_kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
        """Runs ``argv`` on this host to completion (bounded by ``timeout_s``)."""
        return subprocess.run(self.command(argv), timeout=timeout_s, **kwargs)

    def received_bytes(self) -> int:
        """Bytes the network delivered to this host so far (its veth's bridge side sent them)."""
        with open(f"/sys/class/net/{self.link}/statistics/tx_bytes") as f:
            return int(f.read())

    def sent_bytes(self) -> int:
        """Bytes this host sent into the network so far."""
        with open(f"/sys/class/net/{self.link}/statistics/rx_bytes") as f:
            return int(f.read())

    def set_link(self, up: bool) -> None:
        """Cuts (``up=False``) or restores this host's only network link."""
        _ip("link", "set", self.link, "up" if up else "down")


OWNER_FILE = "owner"  # in a SimulatedHosts' folder: "PID CREATE_TIME" of the process that made it


def _owner_alive(folder: str) -> bool | None:
    """Whether the process that made ``folder`` still runs; None where the folder names
    no owner (one being made, or not a SimulatedHosts')."""
    try:
        with open(os.path.join(folder, OWNER_FILE)) as f:
            pid, created = f.read().split()
        return abs(psutil.Process(int(pid)).create_time() - float(created)) < 0.5
    except (OSError, ValueError):
        return None
    except psutil.NoSuchProcess:
        return False


def remove_abandoned_hosts() -> list[str]:
    """Removes what every ``SimulatedHosts`` whose owner is gone left behind (its
    namespaces, bridge, /dev/shm mounts, /etc/netns entries, folder); returns their tags."""
    removed = []
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "ws-hosts-*-*")):
        if _owner_alive(folder) is not False:
            continue
        tag = os.path.basename(folder).split("-")[2]
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(folder + "/")]
        for mount in mounts:
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        for netns in (line.split()[0] for line in listed if line.startswith(f"ws{tag}-")):
            _ip("netns", "del", netns, check=False)
            shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)
        _ip("link", "del", f"wsbr{tag}", check=False)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(tag)
    return removed


class SimulatedHosts:
    """Context manager: ``SimulatedHosts(["a", "b", "c"])[name]`` is a ``Host``."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError("host names must be 1 to 200 distinct names")
        self.tag = f"{random.randrange(16**4):04x}"
        self.subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"wsbr{self.tag}"
        self.dir = tempfile.mkdtemp(prefix=f"ws-hosts-{self.tag}-")
        with open(os.path.join(self.dir, OWNER_FILE), "w") as f:
            f.write(f"{os.getpid()} {psutil.Process().create_time()}")
        self.hosts: dict[str, Host] = {}
        self._names = list(names)
        self._mounts: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> SimulatedHosts:
        remove_abandoned_hosts()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self._names):
                self._add_host(i, name)
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, i: int, name: str) -> None:
        netns, link = f"ws{self.tag}-{name}", f"ws{self.tag}h{i}"
        hostname = f"ws-{name}"
        shm_dir = os.path.join(self.dir, f"{name}-shm")
        os.makedirs(shm_dir)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4g,mode=1777", f"ws-shm-{name}", shm_dir],
                       check=True, capture_output=True, timeout=30)
        self._mounts.append(shm_dir)
        # `ip netns exec` bind-mounts /etc/netns/<netns>/* over /etc: this host's own
        # /etc/hosts, where its hostname means loopback.
        os.makedirs(f"/etc/netns/{netns}", exist_ok=True)
        with open(f"/etc/netns/{netns}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n")
        _ip("netns", "add", netns)
        host = Host(name, netns, f"{self.subnet}.{i + 2}", hostname, shm_dir, link)
        self.hosts[name] = host
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Stops every process, removes namespaces, links, mounts and folders."""
        for host in self.hosts.values():
            for proc in reversed(host.procs):
                stop_process(proc, grace_s=10.0)
        for host in self.hosts.values():
            _ip("netns", "del", host.netns, check=False)
            shutil.rmtree(f"/etc/netns/{host.netns}", ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        for mount in self._mounts:
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["SimulatedHosts", "Host", "unavailable_reason", "remove_abandoned_hosts"]
