"""An emulated multi-host link: one Linux network namespace per rank, joined by a shaped cable.

On one machine, gloo's "network" is the loopback device, a memory copy: a transfer costs CPU
time and no wire time, so there is nothing for overlap to hide. Separate hosts talk over a link
with a rate, and that is what `profile --link 4gbit` builds, on one machine, as root:

    ip netns add tptoy-<pid>-r0                      # one namespace per rank: own devices,
    ip netns add tptoy-<pid>-r1                      # own addresses, own routing table
    ip -n tptoy-<pid>-r0 link add tplink type veth peer name tplink netns tptoy-<pid>-r1
    ip -n tptoy-<pid>-r0 addr add 198.18.0.1/24 dev tplink         # the cable's two ends
    ip -n tptoy-<pid>-r1 addr add 198.18.0.2/24 dev tplink
    ip -n tptoy-<pid>-rK link set lo up ; ip -n tptoy-<pid>-rK link set tplink up   # each K
    tc -n tptoy-<pid>-rK qdisc add dev tplink root tbf rate 4gbit burst 256kb latency 50ms
    ip netns exec tptoy-<pid>-rK env RANK=K WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \\
        MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME=tplink \\
        python -m tensor_parallel_toy profile --device cpu --threads <cores / ranks> ...
    ip netns del tptoy-<pid>-rK                      # the veth pair goes with its namespaces

- With more than two ranks the cables meet at a bridge that lives in one more namespace of ours
  (`tptoy-<pid>-br`), never in the host's own network.
- `tbf` (token bucket filter) limits every rank's *egress* to the rate, so each byte on the
  wire is shaped once. Its `burst` is the bucket (at least one 64 KiB segment, as veth passes
  whole TCP segments) and `latency` bounds the time a packet may queue before it is dropped:
  neither is a propagation delay. A delay needs `netem`, which this kernel lacks, so the link
  has a rate and no delay.
- The addresses come from 198.18.0.0/24, a range reserved for benchmarking (RFC 2544), and
  exist only inside our namespaces: the namespaces have no other device and no route out, so
  no byte can leave them. The host's own interfaces, addresses and routes are never touched.
- `GLOO_SOCKET_IFNAME=tplink` makes gloo use the cable (without it, it binds loopback and the
  ranks cannot reach each other); `MASTER_ADDR` is rank 0's end, where torch's store listens.
- The ranks are the ordinary `torchrun` path (`init_from_env`): nothing in the training code
  knows about the link. Rank 0 reads the link's description from `LINK_ENV` for its results.
- Namespaces are named after the launcher's pid: a launcher killed by SIGKILL cannot clean up,
  so every start removes namespaces of ours whose launcher is dead (`remove_leftovers`).
"""
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "tptoy"
IFNAME = "tplink"
SUBNET = "198.18.0"  # /24; rank r is SUBNET.(r + 1)
MASTER_PORT = 29500  # free by construction: rank 0's namespace is new
LINK_ENV = "TENSOR_PARALLEL_TOY_LINK"
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
RATE_FORMS = "a number and a unit, e.g. 500mbit, 4gbit, 2.5gbit (units: kbit, mbit, gbit)"
PROBE_SECONDS = 0.5


class LinkUnavailable(Exception):
    """This machine cannot build the link (not Linux, not root, no ip/tc, no namespaces or
    no tbf)."""


class RankFailed(Exception):
    """A rank exited with an error; the others were stopped."""


def parse_rate(text):
    """'4gbit' -> 4e9 bits/s. Raises ValueError naming the value and the valid forms."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?)(kbit|mbit|gbit)", text.strip().lower())
    if not match or float(match.group(1)) <= 0:
        detail = (" (no delay: it needs tc netem, which this kernel lacks)" if ":" in text
                  else "")
        raise ValueError(f"--link {text!r}: give the rate as {RATE_FORMS}{detail}")
    return float(match.group(1)) * UNITS[match.group(2)]


def parse_rates(text):
    """'1gbit,4gbit' -> [(1e9, '1gbit'), (4e9, '4gbit')], in increasing rate, no repeats."""
    rates = {}
    for part in text.split(","):
        if not part.strip():
            raise ValueError(f"--link {text!r}: an empty rate between commas; give e.g. "
                             f"4gbit, or several rates as 1gbit,2gbit,4gbit")
        rates[parse_rate(part)] = part.strip().lower()
    return sorted(rates.items())


def check_host():
    """Raise LinkUnavailable (one line) unless this process can build the link."""
    if not sys.platform.startswith("linux"):
        raise LinkUnavailable(f"--link needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise LinkUnavailable("--link creates network namespaces and must run as root "
                              "(e.g. sudo); run without --link for the loopback profile")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkUnavailable(f"--link needs the {' and '.join(missing)} command(s) "
                              f"(package iproute2), not found on PATH")
    # Root is not always enough (a container without CAP_SYS_ADMIN, a kernel without tbf):
    # try both on a namespace of our own that holds nothing but its loopback device.
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
             "burst", "256kb", "latency", "50ms")
    except RuntimeError as e:
        raise LinkUnavailable(f"--link cannot build a shaped link here: {e}") from None
    finally:
        remove_namespaces([probe] if probe in our_namespaces() else [])


def _run(*cmd):
    """One `ip`/`tc` command; its error message becomes ours."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def our_namespaces():
    """{name: launcher pid} of every namespace with our prefix, alive launcher or not."""
    if shutil.which("ip") is None:
        return {}
    found = {}
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{PREFIX}-(\d+)-(?:r\d+|br|probe)", name)
        if match:
            found[name] = int(match.group(1))
    return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(name):
    """The processes running inside namespace `name` ([] when it is gone)."""
    try:
        return [int(pid) for pid in _run("ip", "netns", "pids", name).split()]
    except RuntimeError:
        return []


def remove_namespaces(names):
    """Kill whatever still runs inside each namespace, then delete it (its veths go too)."""
    for name in names:
        for pid in namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(50):  # a killed process leaves its namespace when it is reaped
            try:
                _run("ip", "netns", "del", name)
                break
            except RuntimeError:
                if name not in our_namespaces():
                    break
                time.sleep(0.1)


def remove_leftovers():
    """Delete our namespaces whose launcher is dead (a run killed by SIGKILL); return them."""
    dead = sorted(name for name, pid in our_namespaces().items() if not _alive(pid))
    remove_namespaces(dead)
    return dead


def exit_status(prog, run):
    """`run()` (it builds links and runs ranks on them) as a command line ends it: its return
    value (None: 0), or one line on stderr and 2 when this host cannot build a link, 1 when a
    rank failed, 130 on Ctrl-C (the ranks stopped and the link removed by then)."""
    try:
        return run() or 0
    except LinkUnavailable as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except (RankFailed, subprocess.CalledProcessError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted: stopped the ranks and removed the link", file=sys.stderr)
        return 130


def argv_for_ranks(argv, threads):
    """The launcher's profile flags minus --link (in every form argparse accepts: --link X,
    --link=X, an unambiguous prefix such as --lin X), on CPU, with `threads` torch threads."""
    out, skip = [], False
    for token in argv:
        name = token.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) > 3 and "--link".startswith(name):
            skip = "=" not in token
        else:
            out.append(token)
    return out + ["--device", "cpu", "--threads", str(threads)]


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    # Runs in the child between fork and exec, so it only calls what the parent loaded: if the
    # launcher dies (even by SIGKILL), the kernel kills the rank too.
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# A plain TCP stream from rank 0's namespace to rank 1's: the rate the ranks will really get.
_RECEIVER = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = srv.accept()
got, start = 0, None
while True:
    chunk = conn.recv(1 << 20)
    if not chunk:
        break
    start = start or time.perf_counter()
    got += len(chunk)
print(got, time.perf_counter() - start, flush=True)
"""
_SENDER = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block, end = bytes(1 << 20), time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    conn.sendall(block)
conn.close()
"""


class EmulatedLink:
    """`ranks` namespaces joined at `rate_bps`; a context manager that builds the link on
    entry and removes every namespace it made (and kills what runs there) on exit, whatever
    the exit: success, an exception, Ctrl-C, SIGTERM.

        with EmulatedLink(2, 4e9, "4gbit") as link:
            link.run_ranks([python, "-m", "tensor_parallel_toy", "profile", ...])
    """

    def __init__(self, ranks, rate_bps, rate_text):
        self.ranks, self.rate_bps, self.rate_text = ranks, rate_bps, rate_text
        self.pid = os.getpid()
        self.names = [f"{PREFIX}-{self.pid}-r{r}" for r in range(ranks)]
        self.bridge = f"{PREFIX}-{self.pid}-br" if ranks > 2 else None
        self.addresses = [f"{SUBNET}.{r + 1}" for r in range(ranks)]
        burst_kib = max(256, int(rate_bps / 8 / 1024 * 0.5e-3))  # >= 0.5 ms at the rate
        self.qdisc = f"tbf rate {rate_text.strip().lower()} burst {burst_kib}kb latency 50ms"
        self.measured_bps = None
        self._procs = []

    # -- building ------------------------------------------------------------------------
    def __enter__(self):
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_on_sigterm)
        try:
            self.removed_leftovers = remove_leftovers()
            self._build()
            self.measured_bps = self._measure()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self):
        for name in self.names + ([self.bridge] if self.bridge else []):
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        if self.bridge is None:  # two ranks: one cable, end to end
            _run("ip", "-n", self.names[0], "link", "add", IFNAME, "type", "veth",
                 "peer", "name", IFNAME, "netns", self.names[1])
        else:  # a switch: every rank's cable ends at a port of one bridge
            _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for r, name in enumerate(self.names):
                port = f"port{r}"
                _run("ip", "-n", self.bridge, "link", "add", port, "type", "veth",
                     "peer", "name", IFNAME, "netns", name)
                _run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge, "link", "set", port, "up")
        for name, address in zip(self.names, self.addresses):
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", IFNAME)
            _run("ip", "-n", name, "link", "set", IFNAME, "up")
            _run("tc", "-n", name, "qdisc", "add", "dev", IFNAME, "root", *self.qdisc.split())

    def _in(self, rank, argv, **kwargs):
        return subprocess.Popen(["ip", "netns", "exec", self.names[rank], *argv],
                                preexec_fn=_die_with_parent, **kwargs)

    def _measure(self):
        """Bits per second of one TCP stream rank 0 -> rank 1 over the shaped cable."""
        address, port = self.addresses[1], str(MASTER_PORT)
        receiver = self._in(1, [sys.executable, "-I", "-c", _RECEIVER, address, port],
                            stdout=subprocess.PIPE, text=True)
        sender = None
        try:
            receiver.stdout.readline()  # "ready": listening
            sender = self._in(0, [sys.executable, "-I", "-c", _SENDER, address, port,
                                  str(PROBE_SECONDS)])
            sender.wait(timeout=30)
            got, seconds = receiver.communicate(timeout=30)[0].split()
        finally:
            for proc in (receiver, sender):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return int(got) * 8 / float(seconds)

    # -- running -------------------------------------------------------------------------
    def environment(self, rank):
        """What torchrun would give rank `rank` of a one-rank-per-host job, plus the cable."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.ranks), "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": self.addresses[0],
                "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": IFNAME,
                LINK_ENV: json.dumps(self.describe())}

    def run_ranks(self, argv, poll_s=0.1):
        """Start `argv` once per namespace and wait for all. If one rank fails, stop the others
        at once (they would wait in a collective until its timeout) and raise RankFailed.
        May be called again once it has returned: each call is one run of the ranks."""
        self._procs = []
        for rank in range(self.ranks):
            env = {**os.environ, **self.environment(rank)}
            # Own session: a Ctrl-C reaches the launcher only, which then stops the ranks.
            self._procs.append(self._in(rank, argv, env=env, start_new_session=True))
        while True:
            codes = [proc.poll() for proc in self._procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                self._kill_ranks()
                rank, code = failed[0]
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                raise RankFailed(f"rank {rank} {how}; stopped the other ranks")
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_s)

    def _kill_ranks(self):
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()
        self._procs = []

    def tx_bytes(self):
        """Bytes each rank's end of the link has sent so far (the kernel's counter)."""
        sent = []
        for name in self.names:
            stats = json.loads(_run("ip", "-n", name, "-s", "-j", "link", "show", IFNAME))
            sent.append(stats[0]["stats64"]["tx"]["bytes"])
        return sent

    def describe(self):
        """The link as results.json's meta records it."""
        return {"rate": self.rate_text, "rate_bits_per_s": self.rate_bps,
                "qdisc": self.qdisc + " on every rank's egress",
                "topology": "bridge" if self.bridge else "veth pair",
                "namespaces": self.names + ([self.bridge] if self.bridge else []),
                "addresses": self.addresses, "interface": IFNAME,
                "measured_bits_per_s": self.measured_bps,
                "measured_by": f"one TCP stream rank 0 -> rank 1 for {PROBE_SECONDS} s"}

    # -- tearing down --------------------------------------------------------------------
    def __exit__(self, *exc):
        try:
            self._kill_ranks()
            remove_namespaces([n for n in our_namespaces() if n.startswith(
                f"{PREFIX}-{self.pid}-")])
        finally:
            signal.signal(signal.SIGTERM, self._old_sigterm)
