"""jax_ub.comm's transport choice (``transport="auto"``): the same inputs every process sees after
the survey all-gather, so the decision and its one-line reason are identical on every rank."""

from __future__ import annotations

import dataclasses

import pytest

from jax_ub import comm


@dataclasses.dataclass(frozen=True)
class Dev:
    id: int
    process_index: int


def _groups(procs_per_group):
    out, i = [], 0
    for procs in procs_per_group:
        out.append([Dev(i + k, p) for k, p in enumerate(procs)])
        i += len(procs)
    return out


def test_one_host_with_p2p_is_ipc():
    t, why = comm._choose_transport("auto", _groups([[0, 0, 0, 0]]), ["h0"], [])
    assert (t, why) == ("ipc", "every pair of GPUs of each group can map each other's memory")


def test_group_across_hosts_is_nccl_and_names_the_hosts():
    t, why = comm._choose_transport("auto", _groups([[0, 1], [2, 3]]), ["a", "b", "c", "c"], [])
    assert t == "nccl"
    assert why == "group 0 spans hosts a, b"


def test_pair_without_p2p_is_nccl_and_names_the_pair():
    g = _groups([[0, 0, 0, 0]])
    t, why = comm._choose_transport("auto", g, ["h0"], [(g[0][0], g[0][2])])
    assert (t, why) == ("nccl", "GPU 0 and GPU 2 cannot access each other")


def test_pair_across_processes_names_the_processes():
    g = _groups([[0, 1]])
    t, why = comm._choose_transport("auto", g, ["h", "h"], [(g[0][0], g[0][1])])
    assert (t, why) == ("nccl", "GPU 0 (process 0) and GPU 1 (process 1) cannot access each other")


def test_unverified_pair_is_nccl_for_auto_and_a_warning_for_ipc(caplog):
    g = _groups([[0, 1]])
    unverified = [(g[0][0], g[0][1], "NVML cannot be loaded")]
    t, why = comm._choose_transport("auto", g, ["h", "h"], [], unverified)
    assert t == "nccl"
    assert why == (
        "no process could check whether GPU 0 (process 0) and GPU 1 (process 1) can "
        "access each other (NVML cannot be loaded)"
    )
    with caplog.at_level("WARNING", logger="jax_ub"):
        assert comm._choose_transport("ipc", g, ["h", "h"], [], unverified) == ("ipc", "requested")
    assert "transport='ipc' as requested, although no process could check" in caplog.text


def test_hosts_with_one_name_but_two_boot_ids_are_two_hosts():
    t, why = comm._choose_transport("auto", _groups([[0, 1]]), ["localhost#aa", "localhost#bb"], [])
    assert (t, why) == ("nccl", "group 0 spans hosts localhost#aa, localhost#bb")
    t, why = comm._choose_transport("auto", _groups([[0, 1]]), ["n1#aa", "n2#bb"], [])
    assert why == "group 0 spans hosts n1, n2"


def test_forced_ipc_with_a_blocker_says_why():
    with pytest.raises(ValueError, match=r"group 0 spans hosts a, b.*transport='nccl'"):
        comm._choose_transport("ipc", _groups([[0, 1]]), ["a", "b"], [])


def test_forced_choices_are_kept():
    assert comm._choose_transport("nccl", _groups([[0, 0]]), ["h"], []) == ("nccl", "requested")
    assert comm._choose_transport("ipc", _groups([[0, 0]]), ["h"], []) == ("ipc", "requested")


def test_nccl_is_an_implemented_transport():
    assert "nccl" in comm.IMPLEMENTED_TRANSPORTS and "ipc" in comm.IMPLEMENTED_TRANSPORTS
