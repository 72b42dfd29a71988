"""GPU tier: the real CUDA and NVML calls behind initialize()'s P2P survey (jax_ub.comm.p2p).

The bus ids CUDA gives the extension and the ones NVML gives must name the same GPUs (NVML is what
a process asks about GPUs that CUDA_VISIBLE_DEVICES hides from it), and NVML's P2P answer must
agree with CUDA's wherever both can answer.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from jax_ub.comm import p2p
from tests._gpus import extension

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU


def _mod():
    return extension("pci_bus_ids")  # a GPU machine without the extension fails here


def test_cuda_bus_ids_name_the_gpus_nvidia_smi_lists():
    buses = [p2p.normalize_bus_id(b) for b in _mod().pci_bus_ids()]
    print("cuda_bus_ids", buses)
    assert buses and all(b.count(":") == 2 for b in buses), buses
    assert len(set(buses)) == len(buses)
    if shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        smi = {p2p.normalize_bus_id(line) for line in out.splitlines() if line.strip()}
        print("nvidia_smi_bus_ids", sorted(smi))
        assert set(buses) <= smi


def test_nvml_sees_the_cuda_gpus_and_agrees_on_p2p():
    mod = _mod()
    buses = [p2p.normalize_bus_id(b) for b in mod.pci_bus_ids()]
    nvml_buses, can, note = p2p.nvml_matrix()
    print("nvml", nvml_buses, can, repr(note))
    if note.startswith("NVML cannot be loaded"):
        pytest.skip(note)
    assert note == ""
    assert set(buses) <= set(nvml_buses)
    cuda = mod.p2p_matrix()
    for i, a in enumerate(buses):
        for j, b in enumerate(buses):
            if i != j:
                x, y = nvml_buses.index(a), nvml_buses.index(b)
                assert bool(can[x][y]) == bool(cuda[i][j]), (a, b, can[x][y], cuda[i][j])


def test_nvml_p2p_status_call_returns_a_status():
    """With one GPU no pair is asked about: call the entry point once on (GPU 0, GPU 0) so its
    ctypes signature runs on real NVML (any documented return code, no crash)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as err:
        pytest.skip(f"NVML cannot be loaded: {err}")
    assert lib.nvmlInit_v2() == 0
    try:
        h = ctypes.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(0), ctypes.byref(h)) == 0
        status = ctypes.c_int(-1)
        r = lib.nvmlDeviceGetP2PStatus(h, h, ctypes.c_int(0), ctypes.byref(status))
        print("nvml_p2p_self", r, status.value)
        assert r in (0, 2, 3) and (r != 0 or status.value >= 0)
    finally:
        lib.nvmlShutdown()


def test_two_ranks_on_one_gpu_and_a_hidden_peer():
    """Two processes sharing GPU 0 need no check; a peer GPU that only NVML sees is judged by it."""
    import dataclasses

    mod = _mod()

    @dataclasses.dataclass(frozen=True)
    class Dev:
        id: int
        process_index: int

    reports = [p2p.local_report(mod, {str(p): 0}, use_nvml=True) for p in range(2)]
    print("report", reports[0])
    assert reports[0]["members"]["0"] == p2p.normalize_bus_id(mod.pci_bus_ids()[0])
    assert p2p.judge(reports, [[Dev(0, 0), Dev(1, 1)]])[1:] == ([], [])
