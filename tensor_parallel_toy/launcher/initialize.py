"""Process groups and devices: which backend and device, NCCL's options (ranks sharing one GPU
included), and joining a group from torchrun's environment.

`torchrun ... python -m tensor_parallel_toy profile`: the environment carries RANK, WORLD_SIZE
and MASTER_ADDR/PORT, and `init_from_env()` joins that group (multi-GPU, multi-node). When it
cannot, it raises `LaunchError`, one line naming the address and the variable to check. The
other way in, local ranks started and watched by this process, is pool.py's `WorkerPool`.
"""
import ipaddress
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..guards.collectives import barrier, group_device

DEFAULT_TIMEOUT_S = 60.0


class LaunchError(RuntimeError):
    """The process group could not be formed; the message is one line saying what to check."""


DEVICES = ("auto", "cpu", "cuda")
# Set to 1: several NCCL ranks may share this machine's first GPU (see `share_gpu_env`).
SHARE_GPU_ENV = "TENSOR_PARALLEL_TOY_SHARE_GPU"


def gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def share_gpu_requested(env=os.environ):
    """Whether ranks may share a GPU: SHARE_GPU_ENV=1 (what gpu-check's --share-gpu sets)."""
    return env.get(SHARE_GPU_ENV) == "1"


def nccl_rank_capacity(env=os.environ, version=None):
    """How many NCCL ranks this machine can run: one per GPU; with SHARE_GPU_ENV=1 (a
    correctness run; see `share_gpu_env`) MULTI_RANK_GPU_MAX on one GPU, on either route (NCCL's
    own switch, `version` >= 2.30, default torch's; per-rank host ids before): the most NCCL
    documents for its switch, and more ranks on one GPU were never run here on either route
    (with the suite's pools of 2, 3 and 4 alive together that would be 9 CUDA contexts). The
    tests that need more skip, saying so. With two GPUs or more the switch changes nothing
    (left set from a one-GPU session, it must not cap an 8-GPU run at 2 ranks)."""
    gpus = gpu_count()
    if not (gpus == 1 and share_gpu_requested(env)):
        return gpus
    return MULTI_RANK_GPU_MAX


def choose_backend(world_size, device="auto"):
    """NCCL with one GPU per rank when there are enough GPUs, otherwise gloo on CPU."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of: {', '.join(DEVICES)}")
    gpus, capacity = gpu_count(), nccl_rank_capacity()
    if device == "cpu" or (device == "auto" and capacity < world_size):
        return "gloo"
    if gpus == 0:
        raise ValueError("device=cuda was requested but no CUDA GPU is available; "
                         "use device=cpu (or auto)")
    if capacity < world_size:
        if capacity > gpus:  # sharing, through NCCL's switch
            raise ValueError(f"device=cuda with {world_size} ranks on {gpus} GPU: ranks share "
                             f"it {share_gpu_route()}, which runs at most {capacity}; use at "
                             f"most {capacity} ranks or device=cpu")
        raise ValueError(f"device=cuda with {world_size} ranks needs {world_size} GPUs, "
                         f"found {gpus}; use at most {gpus} ranks or device=cpu "
                         f"(or {SHARE_GPU_ENV}=1 for a correctness run on one GPU)")
    return "nccl"


# NCCL's own switch for several ranks on one GPU: experimental, and only from this version on
# (the NCCL 2.30 release; init.cc's NCCL_PARAM(MultiRankGpuEnable, "MULTI_RANK_GPU_ENABLE", 0)).
# NCCL's documentation of it: "with the default configuration, NCCL should be able to run up to
# 2 ranks per GPU"; more may exhaust the GPU's resources and hang.
MULTI_RANK_GPU_ENV, MULTI_RANK_GPU_SINCE, MULTI_RANK_GPU_MAX = \
    "NCCL_MULTI_RANK_GPU_ENABLE", (2, 30), 2
# Ranks sharing a GPU talk over NCCL's own sockets transport, whatever the machine's image set:
# a network plugin (NCCL_NET_PLUGIN, or a libnccl-net.so on the library path), NCCL_NET naming
# another network, or CollNet would take that route over (NCCL's env.rst: NCCL_NET,
# NCCL_NET_PLUGIN, whose value "none" loads no plugin, NCCL_COLLNET_ENABLE).
SOCKETS_ONLY = {"NCCL_NET": "Socket", "NCCL_NET_PLUGIN": "none", "NCCL_COLLNET_ENABLE": "0"}


def nccl_version():
    """(major, minor, patch) of the NCCL this torch was built with, or None (a CPU build)."""
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError):
        return None


def share_gpu_env(rank, version=None):
    """Environment that lets NCCL run several ranks on one GPU, for NCCL `version` (default:
    torch's). Two routes:
    - NCCL >= 2.30: NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL's own (experimental) switch; without it
      NCCL refuses a second rank on a GPU ("Multiple Ranks are using the same GPU").
    - older NCCL: each rank claims to be its own host (a per-rank NCCL_HOSTID), so NCCL does not
      refuse the second rank ("Duplicate GPU detected") and connects the ranks through sockets
      on loopback. NCCL's maintainers do not support this (NVIDIA/nccl#418).
    Either way the ranks share the GPU's SMs, so timings mean nothing; it runs the real NCCL
    code path, which is what a correctness check on one GPU needs."""
    version = nccl_version() if version is None else version
    if _multi_rank_switch(version):
        return {MULTI_RANK_GPU_ENV: "1", **SOCKETS_ONLY}
    return {"NCCL_HOSTID": f"tensor-parallel-toy-rank-{rank}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", **SOCKETS_ONLY}


def _multi_rank_switch(version):
    return bool(version) and tuple(version[:2]) >= MULTI_RANK_GPU_SINCE


def share_gpu_route(version=None):
    """How ranks share a GPU under NCCL `version` (default: torch's), as a phrase that starts
    with "through" (see `share_gpu_env`)."""
    version = nccl_version() if version is None else version
    since = ".".join(map(str, MULTI_RANK_GPU_SINCE))
    if not version:
        return (f"through {MULTI_RANK_GPU_ENV}=1 where NCCL >= {since}, else a per-rank "
                f"NCCL_HOSTID (this torch has no NCCL)")
    name = "NCCL " + ".".join(map(str, version))
    if _multi_rank_switch(version):
        return (f"through {MULTI_RANK_GPU_ENV}=1, NCCL's own switch ({name} >= {since}; at "
                f"most {MULTI_RANK_GPU_MAX} ranks per GPU)")
    return (f"through a per-rank NCCL_HOSTID over loopback sockets ({name} < {since} has no "
            f"{MULTI_RANK_GPU_ENV}; a route NCCL's maintainers do not support; at most "
            f"{MULTI_RANK_GPU_MAX} ranks per GPU)")


def nccl_options(high_priority_streams=False):
    """ProcessGroupNCCL's options, or None for its defaults. `high_priority_streams`: NCCL's
    internal CUDA streams (the ones the ring's transfers and every asynchronous collective run
    on) get the highest priority, so the GPU schedules their kernels ahead of the GEMMs'. Off
    by default, as in torch; the environment variable TORCH_NCCL_HIGH_PRIORITY=1 does the same
    for every group. A stream created by the caller could not do this: NCCL does not run on it.
    """
    if not high_priority_streams:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def bind_gpu(local_rank, world_size):
    """This rank's GPU: its own, or the first one when ranks share it. Made current, and
    returned for `init_process_group(device_id=...)`, which binds the group to it."""
    device = torch.device("cuda", 0 if gpu_count() < world_size else local_rank)
    torch.cuda.set_device(device)
    return device


def current_device():
    """The device this rank computes on: its GPU under NCCL, else the CPU (the default group's
    `collectives.group_device`)."""
    return group_device()


def set_threads(world_size):
    # Ranks on one CPU machine share its cores; oversubscribing them makes every GEMM slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))


def _is_loopback(address):
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a host name: not resolved here, so a check never waits on DNS


def _host_addresses():
    """This host's name and the addresses it resolves to (gloo's default choice of address)."""
    name = socket.gethostname()
    try:
        return name, sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    except OSError:
        return name, []


def _interfaces():
    try:
        return ", ".join(name for _, name in socket.if_nameindex())
    except OSError:
        return "see `ip addr`"


def gloo_loopback_problem(env, host_name, host_addresses):
    """The one-line problem, or None, of a gloo job that spans several hosts while this host's
    name resolves only to loopback addresses (a common /etc/hosts default, 127.0.1.1).

    gloo advertises the address the host name resolves to; the other hosts would then try to
    reach this rank at their own loopback and fail ("Connection refused"). torchrun exports
    WORLD_SIZE (all ranks) and LOCAL_WORLD_SIZE (ranks on this host): fewer here than in all
    means several hosts, unless MASTER_ADDR itself is a loopback address (all on one machine).
    """
    world = int(env.get("WORLD_SIZE", 1))
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    master = env.get("MASTER_ADDR", "")
    if local >= world or env.get("GLOO_SOCKET_IFNAME") or _is_loopback(master):
        return None
    if not host_addresses or not all(_is_loopback(a) for a in host_addresses):
        return None
    nodes = env.get("GROUP_WORLD_SIZE") or f"{-(-world // local)}"
    return (f"this gloo job spans {nodes} hosts ({world} ranks, {local} here) but this host's "
            f"name {host_name!r} resolves to {', '.join(host_addresses)}, a loopback address "
            f"the other hosts cannot reach; set GLOO_SOCKET_IFNAME to the network interface "
            f"that reaches MASTER_ADDR={master} (interfaces here: {_interfaces()})")


def _wait_for_rendezvous(address, port, timeout_s):
    """Wait until rank 0's rendezvous store accepts connections, or raise one line. (torch's own
    wait reports a miss with a multi-line C++ log on every retry.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=min(5.0, timeout_s)):
                return
        except socket.gaierror as e:
            raise LaunchError(f"MASTER_ADDR={address} does not resolve ({e.strerror}); set it "
                              f"to rank 0's host, as every host can reach it") from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"nothing answers at MASTER_ADDR={address} MASTER_PORT={port} after "
                    f"{timeout_s:g} s ({e.strerror or e}); check that rank 0 runs and that "
                    f"MASTER_ADDR/MASTER_PORT name its host and a port open to this one") \
                    from None
            time.sleep(0.5)


def init_from_env(backend=None, timeout_s=DEFAULT_TIMEOUT_S, high_priority_streams=False):
    """Join the process group described by torchrun's environment variables.

    `timeout_s` bounds both joining and every collective after. Under NCCL each rank binds
    the GPU LOCAL_RANK names (see `nccl_options` for `high_priority_streams`). Raises
    `LaunchError`, one line naming the address and the variable to check, when the group
    cannot be formed: a multi-host gloo job whose host name resolves to loopback (before
    trying), rank 0's store unreachable, or the backend failing to connect the ranks.
    """
    env = os.environ
    world_size = int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or choose_backend(local)
    nccl = {}
    if backend == "nccl":
        local_rank = int(env.get("LOCAL_RANK", 0))
        if gpu_count() < local:  # SHARE_GPU_ENV: choose_backend allowed it
            os.environ.update(share_gpu_env(int(env.get("RANK", 0))))
        nccl = {"device_id": bind_gpu(local_rank, local),
                "pg_options": nccl_options(high_priority_streams)}
    else:
        problem = gloo_loopback_problem(env, *_host_addresses())
        if problem:
            raise LaunchError(problem)
        set_threads(local)
    address, port, rank = env.get("MASTER_ADDR"), env.get("MASTER_PORT"), env.get("RANK")
    if address and port and rank not in (None, "0") and \
            env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun's agent has the store
        _wait_for_rendezvous(address, int(port), timeout_s)
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **nccl)
    except (RuntimeError, ValueError) as e:  # torch's DistError is a RuntimeError
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
        if reason.startswith("[enforce fail"):  # gloo's: the source line, a condition, then why
            reason = reason.rsplit(". ", 1)[-1]
        ifname = env.get("GLOO_SOCKET_IFNAME")
        check = "MASTER_ADDR and MASTER_PORT" + (
            f", and GLOO_SOCKET_IFNAME={ifname} (interfaces here: {_interfaces()})" if ifname
            else ", and for gloo across hosts GLOO_SOCKET_IFNAME" if backend == "gloo" else "")
        raise LaunchError(f"rank {rank} of {world_size} could not form the {backend} process "
                          f"group at MASTER_ADDR={address} MASTER_PORT={port}: {reason}; "
                          f"check {check}") from None
    return backend


def shutdown():
    """Barrier first, so no rank tears down its connections while a peer is still using them."""
    if dist.is_initialized():
        barrier(None)
        dist.destroy_process_group()
