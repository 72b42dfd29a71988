"""Which GPUs of a TP group can map each other's memory, as every process of a launch sees it.

A process sees only the GPUs ``CUDA_VISIBLE_DEVICES`` leaves it, and one process per GPU is a
common launch. So each process reports, by PCI bus id (the same name in every process of a host):

* its host: host name plus the kernel's boot id (containers of one machine share the boot id,
  two machines that both call themselves ``localhost`` do not; NCCL tells hosts apart the same way);
* the GPU of each of its members;
* a verdict for every pair of GPUs of its host that it can check, from each source apart:
  ``cudaDeviceCanAccessPeer`` for the GPUs it sees, NVML's P2P status (which
  ``CUDA_VISIBLE_DEVICES`` does not hide) for all of them.

:func:`judge` then reads the all-gathered reports the same way on every process, so every process
makes the same transport choice. A pair that no process of its host can check is *unverified*.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# NVML's P2P capability indices (nvmlGpuP2PCapsIndex_t) and its OK status (nvmlGpuP2PStatus_t).
_NVML_P2P_READ, _NVML_P2P_WRITE, _NVML_P2P_OK = 0, 1, 0


def host_identity() -> str:
    """``name#bootid`` (``name`` where the boot id cannot be read)."""
    name = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{name}#{boot[:8]}" if boot else name


def host_labels(ids: Iterable[str]) -> dict[str, str]:
    """Short names for host ids in messages: the host name alone unless two hosts share it."""
    ids = sorted(set(ids))
    names = [i.split("#", 1)[0] for i in ids]
    return {i: n if names.count(n) == 1 else i for i, n in zip(ids, names, strict=True)}


class _PciInfo(ctypes.Structure):
    # nvmlPciInfo_t (nvmlDeviceGetPciInfo_v3).
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


def normalize_bus_id(bus: str) -> str:
    """``0000:18:00.0`` (lower case, 4-digit domain) from CUDA's or NVML's spelling (NVML writes an
    8-digit domain: ``00000000:18:00.0``)."""
    bus = bus.strip().lower()
    dom, sep, rest = bus.partition(":")
    if not sep or not rest:
        return bus
    try:
        return f"{int(dom, 16):04x}:{rest}"
    except ValueError:
        return bus


def _load_nvml() -> Any:
    return ctypes.CDLL("libnvidia-ml.so.1")


def nvml_matrix(load: Callable[[], Any] = _load_nvml) -> tuple[list[str], list[list[int]], str]:
    """(bus ids of every GPU NVML sees on this host, can[i][j] as 1/0, "" or why NVML could not be
    used). ``can[i][j]`` is 1 when NVML reports both P2P reads and writes from GPU i to GPU j."""
    try:
        lib = load()
    except OSError as err:
        return [], [], f"NVML cannot be loaded ({err})"
    try:
        if lib.nvmlInit_v2() != 0:
            return [], [], "nvmlInit_v2 failed"
    except AttributeError as err:
        return [], [], f"NVML lacks an entry point ({err})"
    try:
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return [], [], "nvmlDeviceGetCount_v2 failed"
        handles, buses = [], []
        for i in range(count.value):
            h = ctypes.c_void_p()
            info = _PciInfo()
            pci_info = getattr(lib, "nvmlDeviceGetPciInfo_v3", None) or lib.nvmlDeviceGetPciInfo_v2
            if (
                lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(i), ctypes.byref(h)) != 0
                or pci_info(h, ctypes.byref(info)) != 0
            ):
                return [], [], f"NVML could not describe its GPU {i}"
            handles.append(h)
            buses.append(normalize_bus_id(info.busId.decode(errors="replace")))
        n = len(handles)
        can = [[1] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                for cap in (_NVML_P2P_READ, _NVML_P2P_WRITE):
                    status = ctypes.c_int(-1)
                    r = lib.nvmlDeviceGetP2PStatus(
                        handles[i], handles[j], ctypes.c_int(cap), ctypes.byref(status)
                    )
                    if r != 0 or status.value != _NVML_P2P_OK:
                        can[i][j] = 0
        return buses, can, ""
    except AttributeError as err:
        return [], [], f"NVML lacks an entry point ({err})"
    finally:
        with contextlib.suppress(AttributeError):
            lib.nvmlShutdown()


def local_report(
    mod: Any,
    members: dict[str, int],
    *,
    use_nvml: bool,
    nvml: Callable[[], tuple[list[str], list[list[int]], str]] = nvml_matrix,
) -> dict[str, Any]:
    """This process's part of the survey. ``members``: jax device id (as a string) -> CUDA ordinal
    of each GPU of this process in a group; ``mod``: the extension (``pci_bus_ids``,
    ``p2p_matrix``); ``use_nvml``: also ask NVML about the GPUs CUDA does not show this process
    (pointless with one process, which sees every GPU of the mesh)."""
    notes = []
    try:
        cuda_buses = [normalize_bus_id(b) for b in mod.pci_bus_ids()]
    except Exception as err:  # an older build, or no CUDA: every pair with a peer is unverified
        cuda_buses = []
        notes.append(f"no PCI bus ids from CUDA ({type(err).__name__}: {err})")
    try:
        cuda_can = [[int(bool(v)) for v in row] for row in mod.p2p_matrix()]
    except Exception as err:
        cuda_can = []
        notes.append(f"no P2P matrix from CUDA ({type(err).__name__}: {err})")
    if not cuda_buses and not use_nvml and cuda_can:
        # One process sees every GPU of the mesh: CUDA ordinals name them unambiguously.
        cuda_buses = [f"cuda:{i}" for i in range(len(cuda_can))]
    nvml_buses, nvml_can, nvml_note = nvml() if members and use_nvml else ([], [], "")
    if nvml_note:
        notes.append(nvml_note)
    # Kept apart: CUDA's answer is the one the IPC path depends on (judge prefers it).
    found: dict[str, dict[tuple[str, str], int]] = {"nvml": {}, "cuda": {}}
    for source, buses, can in (("nvml", nvml_buses, nvml_can), ("cuda", cuda_buses, cuda_can)):
        for i, a in enumerate(buses):
            for j, b in enumerate(buses):
                if a and b and a != b and i < len(can) and j < len(can[i]):
                    found[source][(a, b)] = can[i][j]
    member_buses = {dev: cuda_buses[o] if 0 <= o < len(cuda_buses) else "" for dev, o in members.items()}
    buses = sorted({b for pairs in found.values() for pair in pairs for b in pair})
    index = {b: k for k, b in enumerate(buses)}
    report: dict[str, Any] = {
        "host": host_identity(),
        "members": member_buses,
        "buses": buses,
        "notes": notes,
    }
    for source, verdicts in found.items():
        matrix = [[-1] * len(buses) for _ in buses]
        for (a, b), v in verdicts.items():
            matrix[index[a]][index[b]] = v
        report[source] = matrix
    return report


def judge(
    reports: Sequence[dict[str, Any]], groups: Sequence[Sequence[Any]]
) -> tuple[list[str], list[tuple[Any, Any]], list[tuple[Any, Any, str]]]:
    """(host id of every process, pairs of devices that cannot map each other, pairs nobody could
    check with the reason) from every process's :func:`local_report`, in process order.

    Devices are the mesh's (``.id``, ``.process_index``); only pairs of one group on one host are
    judged. A pair on one GPU (two ranks sharing it) is fine. Otherwise the reports of that host
    that checked both directions decide: CUDA's checks where any process made one (the IPC path
    depends on them), else NVML's; the pair is bad if any of them says no (so neither the order
    of the processes nor which of them checked changes the verdict).
    """
    hosts = [r["host"] for r in reports]
    bus_of: dict[int, str] = {}
    for r in reports:
        for dev, bus in r["members"].items():
            bus_of[int(dev)] = bus
    tables = []
    for r in reports:
        index = {b: k for k, b in enumerate(r["buses"])}
        tables.append((r["host"], index, r["cuda"], r["nvml"]))

    def verdict(a: str, b: str, host: str) -> int:
        checked: dict[str, list[int]] = {"cuda": [], "nvml": []}
        for h, index, cuda, nvml in tables:
            if h != host or a not in index or b not in index:
                continue
            for source, can in (("cuda", cuda), ("nvml", nvml)):
                ab, ba = can[index[a]][index[b]], can[index[b]][index[a]]
                if ab >= 0 and ba >= 0:
                    checked[source].append(int(ab and ba))
        found = checked["cuda"] or checked["nvml"]
        return min(found) if found else -1

    bad, unverified, seen = [], [], set()
    for g in groups:
        for i, da in enumerate(g):
            for db in g[i + 1 :]:
                key = (min(da.id, db.id), max(da.id, db.id))
                if key in seen:
                    continue
                seen.add(key)
                ha, hb = hosts[da.process_index], hosts[db.process_index]
                if ha != hb:
                    continue  # across hosts: the transport choice names the hosts
                a, b = bus_of.get(da.id, ""), bus_of.get(db.id, "")
                if a and a == b:
                    continue  # one GPU
                if not a or not b:
                    why = "; ".join(
                        reports[da.process_index]["notes"]
                        + (reports[db.process_index]["notes"] if db.process_index != da.process_index else [])
                    )
                    unverified.append((da, db, why or "no PCI bus id"))
                    continue
                v = verdict(a, b, ha)
                if v == 0:
                    bad.append((da, db))
                elif v < 0:
                    notes = sorted({n for r in reports if r["host"] == ha for n in r["notes"]})
                    unverified.append((da, db, "; ".join(notes) or "no process of the host sees both"))
    return hosts, bad, unverified
