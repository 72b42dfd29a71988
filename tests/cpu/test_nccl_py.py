"""jax_ub.comm.nccl: the Python side of the NCCL layer (CPU tier).

What runs without a GPU: library queries (never raise), unique-id publishing over a LocalStore with
one thread per rank, argument checks, the error paths without an extension, and the local-ranks
threading of create_comms against a fake extension. ncclGetUniqueId itself needs no GPU, so it
runs wherever the extension and the nvidia-nccl wheel are installed.
"""

from __future__ import annotations

import threading

import pytest
from _ranks import run_ranks

from jax_ub import _ext
from jax_ub.comm import bootstrap as bs
from jax_ub.comm import nccl


class FakeId:
    """make_id stand-in: a distinct 128-byte id per call, counting the calls."""

    def __init__(self, size: int = nccl.UNIQUE_ID_BYTES) -> None:
        self.calls = 0
        self.size = size
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            self.calls += 1
            return bytes([self.calls]) + bytes(range(self.size - 1))[: self.size - 1]


def no_extension(monkeypatch: pytest.MonkeyPatch, reason: str = "no CUDA extension here") -> None:
    monkeypatch.setattr(_ext, "extension", lambda: None)
    monkeypatch.setattr(_ext, "_load", lambda: (None, reason))


# ------------------------------------------------------------------------------------------------
# Library queries


def test_version_and_library_never_raise():
    v, lib, err = nccl.version(), nccl.library(), nccl.load_error()
    assert isinstance(v, int) and isinstance(lib, str) and isinstance(err, str)
    if v == -1:
        assert lib == "" and err, "no NCCL, so load_error() must say why"
    else:
        assert v >= 21400, f"jax_ub needs NCCL >= 2.14; got {v}"
        assert lib.endswith(".so.2") or "nccl" in lib, lib
        assert err == ""


def test_queries_without_extension(monkeypatch):
    no_extension(monkeypatch, "built without nvcc")
    assert nccl.version() == -1
    assert nccl.library() == ""
    assert nccl.load_error() == "built without nvcc"
    assert nccl.destroy_comm(7) == 0
    with pytest.raises(RuntimeError, match="jax_ub NCCL unavailable: built without nvcc"):
        nccl.unique_id()
    with pytest.raises(RuntimeError, match="built without nvcc"):
        nccl.create_comm(1, b"\0" * 128, 0, 1, 0, 1.0)
    with pytest.raises(RuntimeError, match="built without nvcc"):
        nccl.allgather_bytes(1, 0, b"x")


def test_old_extension_without_nccl(monkeypatch):
    old = type("OldExtension", (), {})()
    monkeypatch.setattr(_ext, "extension", lambda: old)
    assert nccl.version() == -1
    assert "predates NCCL support" in nccl.load_error()
    with pytest.raises(RuntimeError, match="predates NCCL support"):
        nccl.create_comm(1, b"\0" * 128, 0, 1, 0, 1.0)


def test_real_unique_id():
    if nccl.version() < 0:
        pytest.skip(f"NCCL unavailable: {nccl.load_error()}")
    a, b = nccl.unique_id(), nccl.unique_id()
    assert len(a) == len(b) == nccl.UNIQUE_ID_BYTES
    assert a != b


def test_create_comm_checks_the_id_size():
    with pytest.raises(ValueError, match="128 bytes; got 5"):
        nccl.create_comm(1, b"short", 0, 2, 0, 1.0)


# ------------------------------------------------------------------------------------------------
# Unique id through the key-value store


@pytest.mark.parametrize("root", [0, 2])
def test_bootstrap_unique_id_root_publishes_everyone_reads(root):
    world, store, make = 4, bs.LocalStore(), FakeId()

    def rank_fn(r: int) -> bytes:
        ex = bs.KVExchange("t/nccl", r, world, timeout_s=10, client=store)
        return nccl.bootstrap_unique_id(ex, 5, root=root, make_id=make)

    out = run_ranks(world, rank_fn)
    assert make.calls == 1, "only the root may create the id"
    ids = [out[r] for r in range(world)]
    assert all(isinstance(i, bytes) and len(i) == 128 for i in ids), ids
    assert len(set(ids)) == 1
    assert store.list_keys() == [f"t/nccl/nccl_uid_5/{root}"]


def test_bootstrap_unique_id_keys_are_separate():
    world, store, make = 2, bs.LocalStore(), FakeId()

    def rank_fn(r: int) -> tuple[bytes, bytes]:
        ex = bs.KVExchange("t/two", r, world, timeout_s=10, client=store)
        return (nccl.bootstrap_unique_id(ex, 0, make_id=make), nccl.bootstrap_unique_id(ex, 1, make_id=make))

    out = run_ranks(world, rank_fn)
    assert out[0] == out[1]
    assert out[0][0] != out[0][1]
    assert make.calls == 2


def test_bootstrap_unique_id_same_key_twice_is_refused():
    ex = bs.KVExchange("t/once", 0, 1, timeout_s=1, client=bs.LocalStore())
    nccl.bootstrap_unique_id(ex, 3, make_id=FakeId())
    with pytest.raises(ValueError, match="already used"):
        nccl.bootstrap_unique_id(ex, 3, make_id=FakeId())


def test_bootstrap_unique_id_times_out_naming_the_root():
    store = bs.LocalStore()
    ex = bs.KVExchange("t/late", 1, 3, timeout_s=0.3, client=store)
    with pytest.raises(bs.PeerTimeoutError, match=r"rank 1 waited 0\.3 s for rank 0 of world 3"):
        nccl.bootstrap_unique_id(ex, 9, make_id=FakeId())


def test_bootstrap_unique_id_rejects_bad_sizes():
    root = bs.KVExchange("t/bad", 0, 2, timeout_s=1, client=bs.LocalStore())
    with pytest.raises(RuntimeError, match="has 12 bytes, expected 128"):
        nccl.bootstrap_unique_id(root, 1, make_id=FakeId(size=12))

    store = bs.LocalStore()
    store.set("t/bad2/nccl_uid_1/0", b"\x01" * 64)  # what a differently built root would publish
    reader = bs.KVExchange("t/bad2", 1, 2, timeout_s=1, client=store)
    with pytest.raises(RuntimeError, match=r"received a 64-byte unique id .* same jax_ub build"):
        nccl.bootstrap_unique_id(reader, 1, make_id=FakeId())


# ------------------------------------------------------------------------------------------------
# create_comms against a fake extension (no GPU): one thread per local rank


class FakeNcclExtension:
    """Records nccl_comm_create calls; every call waits until all `expect` callers have arrived,
    like ncclCommInitRank does, so a sequential implementation would time out."""

    def __init__(self, expect: int, fail_rank: int | None = None) -> None:
        self.barrier = threading.Barrier(expect, timeout=5)
        self.created: list[tuple] = []
        self.destroyed: list[int] = []
        self.fail_rank = fail_rank
        self._lock = threading.Lock()

    def nccl_version(self) -> int:
        return 23203

    def nccl_comm_create(self, key, uid, rank, world, device, timeout_s):
        self.barrier.wait()
        if rank == self.fail_rank:
            raise RuntimeError(f"jax_ub NCCL: ncclCommInitRank failed on rank {rank}")
        with self._lock:
            self.created.append((key, rank, world, device, len(uid), timeout_s))

    def nccl_comm_destroy(self, key) -> int:
        self.destroyed.append(key)
        return len(self.created)


def test_create_comms_runs_local_ranks_concurrently(monkeypatch):
    fake = FakeNcclExtension(expect=3)
    monkeypatch.setattr(_ext, "extension", lambda: fake)
    nccl.create_comms(4, b"\x07" * 128, ranks=[1, 2, 3], world=4, devices=[0, 1, 2], timeout_s=2.5)
    assert sorted(fake.created) == [(4, 1, 4, 0, 128, 2.5), (4, 2, 4, 1, 128, 2.5), (4, 3, 4, 2, 128, 2.5)]
    assert fake.destroyed == []


def test_create_comms_reports_every_failure_and_cleans_up(monkeypatch):
    fake = FakeNcclExtension(expect=2, fail_rank=1)
    monkeypatch.setattr(_ext, "extension", lambda: fake)
    with pytest.raises(
        RuntimeError,
        match=r"local ranks \[0, 1\] of communicator 6 failed:\n"
        r"  rank 1: jax_ub NCCL: ncclCommInitRank failed on rank 1",
    ):
        nccl.create_comms(6, b"\0" * 128, ranks=[0, 1], world=2, devices=[0, 1], timeout_s=1)
    assert fake.destroyed == [6]


def test_create_comms_checks_lengths():
    with pytest.raises(ValueError, match="differ in length"):
        nccl.create_comms(1, b"\0" * 128, ranks=[0, 1], world=2, devices=[0], timeout_s=1)
