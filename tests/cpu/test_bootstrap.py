"""jax_ub.comm.bootstrap: the key-value rendezvous behind jax_ub.initialize() (CPU tier).

In-process tests run the ranks as threads over a LocalStore (or a fake jax.distributed client);
multi-process tests start real processes under jax.distributed (CPU backend) through
tests/launcher.py, with tests/cpu/_bootstrap_worker.py as the rank program.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from jax_ub.comm import bootstrap as bs

try:
    from tests.launcher import Result, format_failures, parallel_launch
except ImportError:  # tests/ is not a package: import launcher.py from its folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from launcher import Result, format_failures, parallel_launch

WORKER = Path(__file__).resolve().with_name("_bootstrap_worker.py")
CPU_ENV = {"JAX_PLATFORMS": "cpu"}


# ------------------------------------------------------------------------------------------------
# Helpers


from _ranks import run_ranks  # noqa: E402


def blobs(world: int) -> list[bytes]:
    """Binary payloads: empty, every byte value, NULs, a larger random one."""
    rnd = os.urandom(70000)
    return [
        (b"", bytes(range(256)) * 2, b"\x00" * 17, rnd)[r % 4] + bytes([r]) * (r // 4) for r in range(world)
    ]


def results_of(res: Result) -> list[dict]:
    return [json.loads(line) for line in res.lines("RESULT ")]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry))
    return members


def assert_reaped(results: list[Result]) -> None:
    """No child, and nothing in a child's process group, is left running."""
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + 5
    while True:
        left = {r.rank: _group_members(r.pid) for r in results}
        left = {k: v for k, v in left.items() if v}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left running per rank: {left}"
    for r in results:
        assert not _alive(r.pid), f"rank {r.rank} (pid {r.pid}) still alive"
        with pytest.raises(ChildProcessError):
            os.waitpid(r.pid, os.WNOHANG)  # already reaped: not our child any more


# ------------------------------------------------------------------------------------------------
# In-process: LocalStore, threads


def test_local_all_gather_binary_broadcast_barrier():
    world, store = 4, bs.LocalStore()
    data = blobs(world)

    def rank_fn(r: int):
        ex = bs.KVExchange("t/ns", r, world, timeout_s=10, client=store)
        got = ex.all_gather("blobs", data[r])
        root_payload = ex.broadcast("root", b"\x00\xffroot" if r == 2 else None, root=2)
        ex.barrier("done")
        return got, root_payload

    out = run_ranks(world, rank_fn)
    for r in range(world):
        got, root_payload = out[r]
        assert got == data, f"rank {r} got wrong payloads"
        assert root_payload == b"\x00\xffroot"
    assert "t/ns/blobs/3" in store.list_keys()


def test_namespaces_do_not_collide():
    first, second = bs.next_init_id(), bs.next_init_id()
    assert second == first + 1
    assert bs.group_namespace(first, 3) == f"jax_ub/init{first}/group3"
    assert bs.group_namespace(first, "all") == f"jax_ub/init{first}/groupall"
    store, world = bs.LocalStore(), 2

    def rank_fn(r: int):
        a = bs.KVExchange(bs.group_namespace(first, 0), r, world, timeout_s=5, client=store)
        b = bs.KVExchange(bs.group_namespace(second, 0), r, world, timeout_s=5, client=store)
        return a.all_gather("h", b"a%d" % r), b.all_gather("h", b"b%d" % r)

    out = run_ranks(world, rank_fn)
    assert out[0] == out[1] == ([b"a0", b"a1"], [b"b0", b"b1"])


def test_an_announced_failure_ends_the_peers_waits_at_once():
    """Rank 2 fails before the all-gather and says so: the other ranks raise PeerFailedError with
    its message long before their timeout; the barrier after it names rank 2 too."""
    world, timeout, store = 3, 20.0, bs.LocalStore()

    def rank_fn(r: int):
        ex = bs.KVExchange(
            "jax_ub/init7/group0",
            r,
            world,
            timeout_s=timeout,
            client=store,
            peer_names=[f"process {q}" for q in range(world)],
        )
        if r == 2:
            time.sleep(0.3)
            ex.announce_failure("RuntimeError: out of memory")
            ex.announce_failure("a second announcement is ignored")
            return None
        t0 = time.monotonic()
        with pytest.raises(bs.PeerFailedError) as info:
            ex.all_gather("handles", b"%d" % r)
        return str(info.value), time.monotonic() - t0

    out = run_ranks(world, rank_fn)
    for r in (0, 1):
        msg, waited = out[r]
        assert waited < 3, waited
        assert msg == (
            "jax_ub bootstrap all_gather 'handles' (jax_ub/init7/group0): rank 2 "
            "(process 2) failed and will not take part: RuntimeError: out of memory"
        ), msg
    with pytest.raises(ValueError, match="reserved for announce_failure"):
        bs.KVExchange("jax_ub/init7/group1", 0, 1, timeout_s=1, client=store).barrier("failed")


def test_a_barrier_timeout_asks_about_the_call_that_should_have_come():
    ex = bs.KVExchange(
        "jax_ub/init8/group0",
        0,
        2,
        timeout_s=0.2,
        client=bs.LocalStore(),
        peer_names=["process 0", "process 1"],
    )
    with pytest.raises(
        bs.PeerTimeoutError,
        match=r"is process 1 running and did it call "
        r"jax_ub\.shutdown\(\)\?",
    ):
        ex.barrier("shutdown", reached="call jax_ub.shutdown()")


def test_local_timeout_names_every_missing_rank_and_is_bounded():
    world, timeout, store = 4, 0.4, bs.LocalStore()

    def rank_fn(r: int):
        ex = bs.KVExchange("jax_ub/init9/group0", r, world, timeout_s=timeout, client=store)
        t0 = time.monotonic()
        with pytest.raises(bs.PeerTimeoutError) as info:
            ex.all_gather("handles", b"x")
        return str(info.value), time.monotonic() - t0

    out = run_ranks(world, rank_fn, ranks=[0, 2])  # ranks 1 and 3 never publish
    for r in (0, 2):
        assert not isinstance(out[r], BaseException), out[r]
        msg, elapsed = out[r]
        assert elapsed < timeout + 0.5, f"waited {elapsed:.2f} s (per key, not overall?)"
        assert msg == (
            f"jax_ub bootstrap all_gather 'handles' (jax_ub/init9/group0): rank {r} waited 0.4 s for "
            "ranks 1, 3 of world 4, which never published; are the processes holding ranks 1, 3 "
            "running and did they call jax_ub.initialize()? (timeout: JAX_UB_TIMEOUT)"
        )


def test_local_timeout_with_peer_names_and_broadcast():
    names = ["process 0", "process 0", "process 1", "process 1"]
    ex = bs.KVExchange("ns", 0, 4, timeout_s=0.2, client=bs.LocalStore(), peer_names=names)
    with pytest.raises(
        bs.PeerTimeoutError,
        match=r"for rank 3 \(process 1\) of world 4.*is process 1 "
        r"running and did it call jax_ub.initialize\(\)",
    ):
        ex.broadcast("nccl_id", None, root=3)
    with pytest.raises(bs.PeerTimeoutError, match=r"barrier 'end'.*ranks 1 \(process 0\), 2"):
        ex.barrier("end")


def test_late_key_found_by_the_final_probe():
    store = bs.LocalStore()
    ex = bs.KVExchange("ns", 0, 3, timeout_s=0.3, client=store)
    store.set("ns/t/2", b"two")  # rank 2 already there; rank 1 arrives late, after our timeout
    timer = threading.Timer(0.1, store.set, args=("ns/t/1", b"one"))
    timer.start()
    assert ex.all_gather("t", b"zero") == [b"zero", b"one", b"two"]
    timer.join()


def test_agree_passes_on_equal_fields():
    store = bs.LocalStore()

    def rank_fn(r: int):
        ex = bs.KVExchange("ns", r, 3, timeout_s=5, client=store)
        # tuple vs list and key order do not matter
        fields = {"mesh": (2, 2) if r else [2, 2], "dtype": "bf16", "n": 1}
        bs.agree(ex, dict(reversed(fields.items())) if r == 1 else fields)

    assert run_ranks(3, rank_fn) == {0: None, 1: None, 2: None}


def test_agree_mismatch_same_message_on_every_rank():
    world, store = 4, bs.LocalStore()

    def rank_fn(r: int):
        fields = {"layout": [[0, 1], [2, 3]], "dtype": "bfloat16", "version": "0.1.0"}
        if r == 1:
            fields["dtype"] = "float32"
        if r == 3:
            fields["extra"] = 1
            fields["version"] = "0.2.0"
        ex = bs.KVExchange("jax_ub/init1/group0", r, world, timeout_s=5, client=store)
        with pytest.raises(bs.AgreementError) as info:
            bs.agree(ex, fields)
        return str(info.value)

    out = run_ranks(world, rank_fn)
    assert len(set(out.values())) == 1, out
    assert out[0] == (
        "jax_ub bootstrap: the 4 ranks of jax_ub/init1/group0 disagree; every process must call "
        "jax_ub.initialize() with the same mesh, arguments, configuration and jax_ub version. "
        "Ranks 1, 3 differ from rank 0:\n"
        '  rank 1: dtype="float32" (rank 0: "bfloat16")\n'
        '  rank 3: extra=1 (rank 0: <absent>); version="0.2.0" (rank 0: "0.1.0")'
    )


def test_validation_errors():
    store = bs.LocalStore()
    with pytest.raises(ValueError, match="rank must be in"):
        bs.KVExchange("ns", 2, 2, timeout_s=1, client=store)
    with pytest.raises(ValueError, match="namespace"):
        bs.KVExchange("ns/", 0, 2, timeout_s=1, client=store)
    with pytest.raises(ValueError, match="timeout_s"):
        bs.KVExchange("ns", 0, 2, timeout_s=0, client=store)
    ex = bs.KVExchange("ns", 0, 1, timeout_s=1, client=store)
    assert ex.all_gather("a", b"1") == [b"1"]
    with pytest.raises(ValueError, match="tag 'a' was already used"):
        ex.all_gather("a", b"1")
    again = bs.KVExchange("ns", 0, 1, timeout_s=1, client=store)  # same namespace, same rank
    with pytest.raises(RuntimeError, match=r"could not publish key 'ns/a/0'.*next_init_id\(\) once"):
        again.all_gather("a", b"1")
    with pytest.raises(ValueError, match="no '/'"):
        ex.barrier("a/b")
    with pytest.raises(TypeError, match="payload must be bytes"):
        ex.all_gather("s", "text")  # type: ignore[arg-type]


def test_client_none_without_jax_distributed():
    ex = bs.KVExchange("ns", 0, 1, timeout_s=1)  # a lone rank needs no store
    assert ex.broadcast("b", b"x") == b"x"
    if bs._default_client() is None:
        with pytest.raises(RuntimeError, match=r"jax\.distributed\.initialize"):
            bs.KVExchange("ns", 0, 2, timeout_s=1)


# ------------------------------------------------------------------------------------------------
# In-process: fake jax.distributed clients (string-only and bytes + dir_get variants)


class _FakeClient:
    """Mimics DistributedRuntimeClient's errors: DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS."""

    def __init__(self) -> None:
        self.data: dict[str, object] = {}
        self.cv = threading.Condition()

    def _set(self, key, value):
        with self.cv:
            if key in self.data:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.data[key] = value
            self.cv.notify_all()

    def _get(self, key, timeout_in_ms):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.data, timeout=timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]


class _StringOnlyClient(_FakeClient):
    def key_value_set(self, key: str, value: str) -> None:
        assert isinstance(value, str) and value.isascii()
        self._set(key, value)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self._get(key, timeout_in_ms)


class _BytesDirClient(_FakeClient):
    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self._set(key, value)

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        return self._get(key, timeout_in_ms)

    def key_value_dir_get_bytes(self, key: str) -> list[tuple[str, bytes]]:
        with self.cv:
            return [(k, v) for k, v in sorted(self.data.items()) if k.startswith(key)]


@pytest.mark.parametrize(
    "client_cls", [_StringOnlyClient, _BytesDirClient], ids=["string-base64", "bytes-dirget"]
)
def test_fake_jax_client_round_trip_and_timeout(client_cls):
    client, world = client_cls(), 3
    data = blobs(world)

    def rank_fn(r: int):
        ex = bs.KVExchange("jax_ub/init1/group0", r, world, timeout_s=5, client=client)
        return ex.all_gather("blobs", data[r])

    assert run_ranks(world, rank_fn) == dict.fromkeys(range(world), data)
    ex = bs.KVExchange("jax_ub/init1/group0", 1, world, timeout_s=0.3, client=client)
    client._set("jax_ub/init1/group0/late/2", b"" if client_cls is _BytesDirClient else "")
    with pytest.raises(bs.PeerTimeoutError, match=r"rank 1 waited 0\.3 s for rank 0 of world 3"):
        ex.all_gather("late", b"x")


def test_store_failure_is_reported_not_hidden():
    class Broken(_BytesDirClient):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise RuntimeError("UNAVAILABLE: Socket closed")

    ex = bs.KVExchange("ns", 0, 2, timeout_s=1, client=Broken())
    with pytest.raises(
        RuntimeError,
        match=r"all_gather 'h' \(ns\): rank 0 could not read rank 1's "
        r"key 'ns/h/1': UNAVAILABLE",
    ) as info:
        ex.all_gather("h", b"x")
    assert not isinstance(info.value, bs.PeerTimeoutError)
    # A read cancelled because jax.distributed's service went away says what the user did wrong.
    assert "call jax_ub.shutdown() before it" in str(info.value)


def test_a_failing_read_of_a_live_service_does_not_blame_jax_distributed_shutdown():
    class Broken(_BytesDirClient):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise RuntimeError("INTERNAL: something else")

    ex = bs.KVExchange("ns", 0, 2, timeout_s=1, client=Broken())
    with pytest.raises(RuntimeError, match="INTERNAL: something else") as info:
        ex.all_gather("h", b"x")
    assert "jax.distributed.shutdown" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# The launcher itself (no jax in the children)


def test_launcher_env_exit_codes_and_report(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    res = parallel_launch(
        2, WORKER, ["env"], env={"JAX_UB_TEST_EXTRA": "x"}, timeout_s=30, devices_per_proc=2
    )
    assert_reaped(res)
    assert [r.returncode for r in res] == [0, 3]
    assert [r.ok for r in res] == [True, False]
    envs = [results_of(r)[0] for r in res]
    assert envs[0]["env"]["JAX_UB_TEST_COORD"] == envs[1]["env"]["JAX_UB_TEST_COORD"]
    for r, info in enumerate(envs):
        assert info["pgid"] == info["pid"] == res[r].pid  # own process group
        assert info["env"] | {"JAX_UB_TEST_COORD": None} == {
            "JAX_UB_TEST_COORD": None,
            "JAX_UB_TEST_NPROCS": "2",
            "JAX_UB_TEST_RANK": str(r),
            "CUDA_VISIBLE_DEVICES": f"{2 * r},{2 * r + 1}",
            "NCCL_NVLS_ENABLE": "0",
            "NVSHMEM_DISABLE_NVLS": "1",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "JAX_UB_TEST_EXTRA": "x",
        }
    report = format_failures(res)
    assert "rank 1 (pid" in report and "exit 3" in report and "stderr of rank 1" in report


@pytest.mark.parametrize("parent,want", [(None, ["0", "1", "0", "1"]), ("5,7", ["5", "7", "5", "7"])])
def test_launcher_share_gpus_wraps_ranks_onto_fewer_gpus(monkeypatch, parent, want):
    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    res = parallel_launch(4, WORKER, ["env"], timeout_s=30, share_gpus=2)
    assert_reaped(res)
    assert [results_of(r)[0]["env"]["CUDA_VISIBLE_DEVICES"] for r in res] == want


def test_launcher_rejects_two_device_layouts():
    with pytest.raises(ValueError, match="devices_per_proc or share_gpus, not both"):
        parallel_launch(2, WORKER, ["env"], devices_per_proc=1, share_gpus=1)
    with pytest.raises(ValueError, match="share_gpus must be >= 1; got 0"):
        parallel_launch(2, WORKER, ["env"], share_gpus=0)


def test_launcher_kills_hung_children_and_grandchildren():
    t0 = time.monotonic()
    res = parallel_launch(2, WORKER, ["hang"], timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert all(r.timed_out and not r.ok for r in res)
    assert "killed after the timeout" in format_failures(res)
    grandchildren = [results_of(r)[0]["grandchild"] for r in res if results_of(r)]
    assert_reaped(res)
    for pid in grandchildren:
        assert not _alive(pid), f"grandchild {pid} survived"


# ------------------------------------------------------------------------------------------------
# Multi-process under jax.distributed (CPU backend)


def test_multiprocess_all_gather_broadcast_namespaces():
    res = parallel_launch(4, WORKER, ["gather"], env=CPU_ENV, timeout_s=60)
    assert_reaped(res)
    assert all(r.ok for r in res), format_failures(res)
    for r in res:
        (info,) = results_of(r)
        assert info["ok"] and info["rank"] == r.rank
        assert info["namespaces"] == ["jax_ub/init1/group0", f"jax_ub/init2/group{r.rank % 2}"]


def test_multiprocess_agreement_mismatch_fails_every_rank_identically():
    res = parallel_launch(3, WORKER, ["disagree", "2"], env=CPU_ENV, timeout_s=60)
    assert_reaped(res)
    assert all(r.ok for r in res), format_failures(res)
    messages = [results_of(r)[0]["error"] for r in res]
    assert messages[0] is not None and messages.count(messages[0]) == 3, messages
    assert messages[0].endswith(
        "Rank 2 differs from rank 0:\n"
        '  rank 2: buffer_mib=128 (rank 0: 64); dtype="float32" (rank 0: "bfloat16")'
    )


@pytest.mark.parametrize(
    ("nprocs", "mode", "missing"),
    [(3, "silent", [2]), (3, "exit", [2]), (4, "silent", [0, 2])],
    ids=["np3-silent-rank2", "np3-exits-rank2", "np4-silent-ranks0,2"],
)
def test_multiprocess_missing_peer_times_out_with_its_name(nprocs, mode, missing):
    timeout = 3.0
    res = parallel_launch(
        nprocs, WORKER, ["timeout", mode, str(timeout), *map(str, missing)], env=CPU_ENV, timeout_s=60
    )
    assert_reaped(res)
    waiting = [r for r in res if r.rank not in missing]
    assert all(r.ok for r in waiting), format_failures(res)
    ranks = ", ".join(map(str, missing))
    for r in waiting:
        (info,) = results_of(r)
        assert info["error"] is not None, format_failures(res)
        assert info["elapsed"] < timeout + 5, info
        assert (
            f"all_gather 'handles' (jax_ub/init1/group0): rank {r.rank} waited 3 s for "
            f"{'rank' if len(missing) == 1 else 'ranks'} {ranks} of world {nprocs}, which never "
            "published"
        ) in info["error"]


def test_agree_shows_each_rank_note_on_a_differing_field_only():
    """Notes (a file's path per rank) are not compared: equal fields with other notes agree."""
    world, store = 3, bs.LocalStore()
    rng = random.Random(3)
    paths = [f"/data/rank{r}/{rng.randrange(1 << 30):x}.json" for r in range(world)]

    def rank_fn(r: int, differ: bool, ns: str):
        ex = bs.KVExchange(ns, r, world, timeout_s=5, client=store)
        fields = {"tables": "abc" if not (differ and r == 2) else "unreadable", "n": 4}
        notes = {"tables": f"file {paths[r]}", "n": f"n note {r}"}
        try:
            bs.agree(ex, fields, notes=notes)
        except bs.AgreementError as e:
            return str(e)
        return None

    assert run_ranks(world, lambda r: rank_fn(r, False, "same")) == {0: None, 1: None, 2: None}
    out = run_ranks(world, lambda r: rank_fn(r, True, "differ"))
    assert len(set(out.values())) == 1, out
    assert out[0].endswith(
        "Rank 2 differs from rank 0:\n"
        f'  rank 2: tables="unreadable" (rank 0: "abc") [rank 2: file {paths[2]}; rank 0: file {paths[0]}]'
    ), out[0]
    assert "n note" not in out[0]
