"""jax_ub.comm.p2p: which GPUs of a TP group can map each other's memory when every process sees only
some of its host's GPUs (one process per GPU under CUDA_VISIBLE_DEVICES), and the transport that
initialize() picks from it. CUDA and NVML are stand-ins here; the real calls run in tests/gpu."""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest

from jax_ub import comm
from jax_ub.comm import p2p

BUS = [f"0000:{0x18 + 0x10 * i:02x}:00.0" for i in range(4)]


@dataclasses.dataclass(frozen=True)
class Dev:
    id: int
    process_index: int


class Mod:
    """The extension's pci_bus_ids/p2p_matrix for the GPUs one process sees."""

    def __init__(self, buses, can=None):
        self.buses = buses
        self.can = can if can is not None else [[1] * len(buses) for _ in buses]

    def pci_bus_ids(self):
        return list(self.buses)

    def p2p_matrix(self):
        return self.can


def no_nvml():
    return [], [], "NVML cannot be loaded (stand-in)"


def nvml_of(can):
    return lambda: (list(BUS), can, "")


def one_gpu_per_process(nvml, n=4):
    """n processes, each seeing (CUDA) only its own GPU; one group of all n."""
    group = [Dev(i, i) for i in range(n)]
    reports = [p2p.local_report(Mod([BUS[i]]), {str(i): 0}, use_nvml=True, nvml=nvml) for i in range(n)]
    return [group], reports


def test_normalize_bus_id_spells_cuda_and_nvml_alike():
    assert p2p.normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert p2p.normalize_bus_id("0000:1A:00.0") == "0000:1a:00.0"
    assert p2p.normalize_bus_id(" 0000:18:00.0\n") == "0000:18:00.0"
    assert p2p.normalize_bus_id("junk") == "junk"


def test_one_process_seeing_every_gpu_judges_with_cuda():
    can = [[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]]
    group = [Dev(i, 0) for i in range(4)]
    report = p2p.local_report(
        Mod(BUS, can),
        {str(i): i for i in range(4)},
        use_nvml=False,
        nvml=lambda: (_ for _ in ()).throw(AssertionError("NVML called")),
    )
    hosts, bad, unverified = p2p.judge([report], [group])
    assert bad == [(group[0], group[2])] and unverified == []
    assert hosts == [p2p.host_identity()]


def test_one_gpu_per_process_is_judged_by_nvml():
    ok = [[1] * 4 for _ in range(4)]
    groups, reports = one_gpu_per_process(nvml_of(ok))
    assert p2p.judge(reports, groups)[1:] == ([], [])
    can = [row[:] for row in ok]
    can[3][1] = 0  # one direction is enough to rule the pair out
    groups, reports = one_gpu_per_process(nvml_of(can))
    _, bad, unverified = p2p.judge(reports, groups)
    assert bad == [(groups[0][1], groups[0][3])] and unverified == []


def test_one_gpu_per_process_without_nvml_is_unverified_and_says_why():
    groups, reports = one_gpu_per_process(no_nvml, n=2)
    _, bad, unverified = p2p.judge(reports, groups)
    assert bad == []
    assert [(a.id, b.id) for a, b, _ in unverified] == [(0, 1)]
    assert "NVML cannot be loaded (stand-in)" in unverified[0][2]
    t, why = comm._choose_transport("auto", groups, ["h", "h"], bad, unverified)
    assert t == "nccl" and "GPU 0 (process 0) and GPU 1 (process 1)" in why


def test_ranks_sharing_one_gpu_need_no_check():
    group = [Dev(0, 0), Dev(1, 1)]
    reports = [p2p.local_report(Mod([BUS[0]]), {str(p): 0}, use_nvml=True, nvml=no_nvml) for p in range(2)]
    assert p2p.judge(reports, [group])[1:] == ([], [])


def test_cuda_verdict_overrides_nvml_where_a_process_sees_both():
    nvml_says_no = [[1, 0], [0, 1]]
    report = p2p.local_report(
        Mod(BUS[:2], [[1, 1], [1, 1]]),
        {"0": 0, "1": 1},
        use_nvml=True,
        nvml=lambda: (BUS[:2], nvml_says_no, ""),
    )
    assert p2p.judge([report], [[Dev(0, 0), Dev(1, 0)]])[1:] == ([], [])


def test_pairs_on_two_hosts_are_left_to_the_host_check():
    group = [Dev(0, 0), Dev(1, 1)]
    reports = [p2p.local_report(Mod([BUS[p]]), {str(p): 0}, use_nvml=True, nvml=no_nvml) for p in range(2)]
    reports[1]["host"] = "elsewhere#12345678"
    hosts, bad, unverified = p2p.judge(reports, [group])
    assert (bad, unverified) == ([], [])
    assert comm._choose_transport("auto", [group], hosts, bad, unverified)[0] == "nccl"


def test_an_extension_without_bus_ids_leaves_peers_unverified():
    class Old:
        def p2p_matrix(self):
            return [[1]]

    group = [Dev(0, 0), Dev(1, 1)]
    reports = [p2p.local_report(Old(), {str(p): 0}, use_nvml=True, nvml=no_nvml) for p in range(2)]
    _, bad, unverified = p2p.judge(reports, [group])
    assert bad == [] and len(unverified) == 1
    assert "no PCI bus ids from CUDA (AttributeError" in unverified[0][2]


def test_host_labels_keep_boot_ids_only_where_names_collide():
    assert p2p.host_labels(["a#1", "b#2"]) == {"a#1": "a", "b#2": "b"}
    assert p2p.host_labels(["a#1", "a#2", "b"]) == {"a#1": "a#1", "a#2": "a#2", "b": "b"}


class FakeNvml:
    """libnvidia-ml's entry points as ctypes calls them (out-arguments by reference)."""

    def __init__(self, buses, can, fail_init=False):
        self.buses, self.can, self.fail_init, self.shut = buses, can, fail_init, False

    def nvmlInit_v2(self):
        return 1 if self.fail_init else 0

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.buses)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, i, handle):
        handle._obj.value = 0x1000 + i.value
        return 0

    def nvmlDeviceGetPciInfo_v3(self, handle, info):
        info._obj.busId = self.buses[handle.value - 0x1000].encode()
        return 0

    def nvmlDeviceGetP2PStatus(self, a, b, cap, status):
        status._obj.value = 0 if self.can[a.value - 0x1000][b.value - 0x1000] else 3
        return 0


def test_nvml_matrix_reads_bus_ids_and_both_directions_of_p2p():
    lib = FakeNvml(
        ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3a:00.0"], [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    )
    buses, can, note = p2p.nvml_matrix(lambda: lib)
    assert note == ""
    assert buses == ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"]
    assert can == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert lib.shut


def test_nvml_matrix_reports_why_it_could_not_be_used():
    def missing():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert p2p.nvml_matrix(missing) == (
        [],
        [],
        "NVML cannot be loaded (libnvidia-ml.so.1: cannot open shared object file)",
    )
    lib = FakeNvml(["00000000:18:00.0"], [[1]], fail_init=True)
    assert p2p.nvml_matrix(lambda: lib)[2] == "nvmlInit_v2 failed"


def test_survey_in_one_process_uses_the_extension(monkeypatch):
    from jax_ub import _ext

    can = [[1, 0], [0, 1]]
    monkeypatch.setattr(_ext, "extension", lambda: Mod(BUS[:2], can))

    @dataclasses.dataclass(frozen=True)
    class Gpu:
        id: int
        local_hardware_id: int
        process_index: int = 0

    group = [Gpu(0, 0), Gpu(1, 1)]
    hosts, bad, unverified = comm._survey(None, [group])
    assert bad == [(group[0], group[1])] and unverified == [] and len(hosts) == 1
    assert comm._choose_transport("auto", [group], hosts, bad, unverified) == (
        "nccl",
        "GPU 0 and GPU 1 cannot access each other",
    )


def test_the_process_that_sees_both_gpus_decides_over_another_process_nvml():
    """Process 0 has GPU 0, process 1 GPUs 1 and 2. NVML (process 0's report comes first) says
    1<->2 is fine; CUDA in process 1, which runs both, says no: the pair is bad."""
    nvml_ok = nvml_of([[1] * 4 for _ in range(4)])
    group = [Dev(0, 0), Dev(1, 1), Dev(2, 1)]
    reports = [
        p2p.local_report(Mod([BUS[0]]), {"0": 0}, use_nvml=True, nvml=nvml_ok),
        p2p.local_report(Mod(BUS[1:3], [[1, 0], [0, 1]]), {"1": 0, "2": 1}, use_nvml=True, nvml=nvml_ok),
    ]
    hosts, bad, unverified = p2p.judge(reports, [group])
    assert bad == [(group[1], group[2])] and unverified == []
    t, why = comm._choose_transport("auto", [group], hosts, bad, unverified)
    assert t == "nccl" and why == "GPU 1 (process 1) and GPU 2 (process 1) cannot access each other"


def _oracle(sees, cuda, nvml, a, b):
    """The verdict on GPUs a, b of one host: any CUDA check (of a process that sees both), else
    any NVML check, says no -> 0; nothing checked -> -1."""
    cuda_says = [cuda[p][a][b] and cuda[p][b][a] for p, s in enumerate(sees) if a in s and b in s]
    nvml_says = [nvml[a][b] and nvml[b][a]] if nvml is not None else []
    found = cuda_says or nvml_says
    return int(all(found)) if found else -1


@pytest.mark.parametrize("seed", range(40))
def test_judge_matches_the_rule_on_random_layouts(seed):
    rng = random.Random(seed)
    n_gpu, n_proc = rng.randint(2, 4), rng.randint(1, 4)
    sees = [sorted(rng.sample(range(n_gpu), rng.randint(1, n_gpu))) for _ in range(n_proc)]
    cuda = [
        [[1 if i == j else rng.random() < 0.8 for j in range(n_gpu)] for i in range(n_gpu)]
        for _ in range(n_proc)
    ]
    nvml = (
        [[1 if i == j else rng.random() < 0.8 for j in range(n_gpu)] for i in range(n_gpu)]
        if rng.random() < 0.7
        else None
    )
    nvml_fn = (lambda: (BUS[:n_gpu], nvml, "")) if nvml is not None else no_nvml
    # Every GPU a process sees is one rank of the group (the first process that sees it).
    owner = {}
    for p, s in enumerate(sees):
        for g in s:
            owner.setdefault(g, p)
    order = list(range(n_proc))
    reports = []
    for p in order:
        can = [[cuda[p][i][j] for j in sees[p]] for i in sees[p]]
        members = {str(g): sees[p].index(g) for g in sees[p] if owner[g] == p}
        reports.append(
            p2p.local_report(Mod([BUS[g] for g in sees[p]], can), members, use_nvml=n_proc > 1, nvml=nvml_fn)
        )
    group = [Dev(g, owner[g]) for g in sorted(owner)]
    _, bad, unverified = p2p.judge(reports, [group])
    want_bad, want_unverified = [], []
    for i, da in enumerate(group):
        for db in group[i + 1 :]:
            v = _oracle(sees, cuda, nvml if n_proc > 1 else None, da.id, db.id)
            (want_bad if v == 0 else want_unverified if v < 0 else []).append((da, db))
    assert bad == want_bad, (sees, cuda, nvml)
    assert [(a, b) for a, b, _ in unverified] == want_unverified, (sees, cuda, nvml)


def test_one_process_without_bus_ids_judges_by_cuda_ordinal():
    """An extension that predates pci_bus_ids: with one process the ordinals name the GPUs."""

    class Old:
        def p2p_matrix(self):
            return [[1, 1, 0], [1, 1, 1], [0, 1, 1]]

    group = [Dev(i, 0) for i in range(3)]
    report = p2p.local_report(Old(), {str(i): i for i in range(3)}, use_nvml=False)
    _, bad, unverified = p2p.judge([report], [group])
    assert bad == [(group[0], group[2])] and unverified == []


def test_auto_says_at_warning_when_it_runs_nccl_for_want_of_a_check(caplog):
    groups, reports = one_gpu_per_process(no_nvml, n=2)
    hosts, bad, unverified = p2p.judge(reports, groups)
    with caplog.at_level(logging.WARNING, logger="jax_ub"):
        assert comm._choose_transport("auto", groups, hosts, bad, unverified)[0] == "nccl"
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    msg = rec.getMessage()
    assert "transport 'auto' runs nccl, not ipc" in msg and "NVML cannot be loaded (stand-in)" in msg
    assert "GPU 0 (process 0) and GPU 1 (process 1)" in msg
