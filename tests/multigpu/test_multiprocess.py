"""Multi-GPU tier, one process per GPU under jax.distributed (KV-store or NCCL bootstrap; CUDA IPC or
NCCL transport).

Where there are fewer GPUs than ranks, several processes share a GPU (CUDA IPC works between
processes on one GPU), so the ipc cases run even on a single GPU: correctness only, shared GPUs
say nothing of speed. So do the NCCL cases: NCCL refuses two ranks of one host on one GPU, so the
launcher makes each rank that shares its GPU a host of its own for NCCL (NCCL_HOSTID), and NCCL
moves the bytes through its socket transport over loopback. Skips without a CUDA GPU. Uses
tests/launcher.py: every child is killed and reaped.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests._gpus import driver_gpus
from tests.launcher import format_failures, parallel_launch

WORKER = Path(__file__).with_name("_mp_worker.py")


NGPU = driver_gpus()
# Marked gpu, not multigpu: the ipc cases run with the ranks sharing one GPU (tests/conftest.py
# skips it without a GPU).
pytestmark = pytest.mark.gpu
ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_UB_TIMEOUT": "60"}


def _layout(n: int) -> dict:
    """One GPU per process where there are enough, else the ranks share the GPUs round robin."""
    return dict(devices_per_proc=1) if n <= NGPU else dict(share_gpus=NGPU)


def _world(limit: int) -> int:
    """Every GPU there is, up to ``limit``, and at least 2 ranks (sharing one GPU if need be)."""
    return max(2, min(NGPU, limit))


def _exchange(capsys, n, bootstrap, transport, extra_env=None, expect=None, timeout_s=240, **layout):
    """Runs the worker's "exchange" mode on n ranks; ``expect``: the transport that ``transport``
    (e.g. ``auto``) must resolve to. Returns the results."""
    env = dict(ENV, JAX_UB_BOOTSTRAP=bootstrap, JAX_UB_TRANSPORT=transport, **(extra_env or {}))
    transport = expect or transport
    results = parallel_launch(n, WORKER, ["exchange"], env=env, timeout_s=timeout_s, fail_fast_s=30, **layout)
    with capsys.disabled():
        for r in results:
            print(f"\n[{bootstrap}/{transport}, {n} ranks] rank {r.rank}: " + "; ".join(r.lines("RESULT ")))
    assert all(r.ok for r in results), format_failures(results)
    want = {
        "all_gather",
        "reduce_scatter",
        "ag_gemm_bfloat16",
        "gemm_rs_float32",
        "gemm_rs_chain_bfloat16",
        "gemm_rs_chain_float32",
    }
    want |= {f"bulk_{op}_{d}" for d in ("bfloat16", "float32") for op in ("ag", "ag_gemm", "rs", "rs_gemm")}
    if transport == "ipc":
        want |= {
            f"{op}_{m}_{d}"
            for d in ("bfloat16", "float32")
            for op, m in (
                ("ag_gemm", "all_peer"),
                ("ag_gemm", "push"),
                ("gemm_rs", "pipeline"),
                ("gemm_rs", "columns"),
                ("ag_gemm", "push2"),
                ("gemm_rs", "chain_cols"),
                ("ag_gemm", "push_merge"),
            )
        }
    want |= {
        "unaligned_plans_built_at_execute",
        "unaligned_rs_ring_bfloat16",
        "unaligned_ag_ring0_float32",
        "unaligned_bulk_ag_bfloat16",
    }
    for r in results:
        names = {ln.split()[0] for ln in r.lines("RESULT ")}
        assert want <= names, sorted(want - names)
        assert r.lines("RESULT transport ") == [f"{transport} bootstrap {bootstrap}"]
    return results


@pytest.mark.parametrize("bootstrap,transport", [("kv", "ipc"), ("nccl", "ipc"), ("kv", "nccl")])
def test_one_process_per_gpu_exchange_and_overlap_ops(capsys, bootstrap, transport):
    """One process per GPU, every GPU there is up to 8 (tp=8 over one NVLink domain); on one GPU,
    two processes sharing it."""
    n = _world(8)
    _exchange(capsys, n, bootstrap, transport, **_layout(n))


@pytest.mark.parametrize(
    "chain_pieces",
    [
        pytest.param(
            None,
            marks=pytest.mark.skipif(
                NGPU == 4, reason="test_exchange_one_process_per_gpu runs world 4 on this machine"
            ),
        ),
        1,
        3,
    ],
)
def test_world_four(capsys, chain_pieces):
    """Every schedule's step order at world 4 (the ring/chain neighbours, the pipeline's streams,
    the chain's per-piece flags): four processes over CUDA IPC (the KV bootstrap and the ipc
    transport), one per GPU where there are 4 or more, else sharing them (correctness only:
    shared GPUs say nothing of speed). The chain's piece counts run on every machine: the
    one-process-per-GPU case runs the default count only."""
    extra = {} if chain_pieces is None else {"JAX_UB_EXPERIMENTAL_RS_CHAIN_PIECES": str(chain_pieces)}
    _exchange(capsys, 4, "kv", "ipc", extra, **_layout(4))


@pytest.mark.skipif(NGPU >= 8, reason="one process per GPU covers world 8 on this machine")
def test_world_eight_on_fewer_gpus(capsys):
    """tp=8's step orders before an 8-GPU machine: eight processes over the GPUs there are (four
    per GPU on a 2-GPU machine), every schedule of both ops, the bulk forms and the piece variants
    over CUDA IPC, each rank checked against its float32 reference. Correctness only."""
    _exchange(capsys, 8, "kv", "ipc", timeout_s=420, share_gpus=NGPU)


def _two_hosts(n: int) -> str:
    """JAX_UB_TEST_HOSTS for n ranks: the first half on "hostA", the rest on "hostB"."""
    return ",".join("hostA" if r < n // 2 else "hostB" for r in range(n))


# NCCL between processes of one machine as it runs between hosts: no peer mapping (P2P) and no
# shared memory, so every byte goes through its network transport (sockets over loopback).
NCCL_OVER_NETWORK = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_NET": "Socket",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}


def test_tp_group_across_hosts_chooses_nccl_over_the_network(capsys):
    """A multi-host launch on one machine: each process reports its own host name, and the TP
    group spans two "hosts". transport='auto' must pick nccl (CUDA IPC cannot cross hosts), and
    every op of both transports' schedules must be right with NCCL moving the bytes through its
    network transport, as between real hosts."""
    n = _world(4)
    hosts = _two_hosts(n)
    results = _exchange(
        capsys, n, "kv", "auto", dict(NCCL_OVER_NETWORK, JAX_UB_TEST_HOSTS=hosts), expect="nccl", **_layout(n)
    )
    for r in results:
        assert r.lines("RESULT hosts ") == [hosts]
        # NCCL's own log says which transport its channels use: the network, never P2P or SHM.
        log = r.stdout + r.stderr  # NCCL_DEBUG writes to stdout
        assert "via NET/Socket" in log, log[-3000:]
        assert "via P2P" not in log and "via SHM" not in log, log[-3000:]


def _dp_by_tp(capsys, n, label, transport="ipc", extra_env=None):
    """The worker's "dptp" mode on n processes (one per GPU, or several per GPU where there are
    fewer): every method of both ops right in each of the two groups. Returns the results."""
    env = dict(ENV, JAX_UB_BOOTSTRAP="kv", JAX_UB_TRANSPORT=transport, **(extra_env or {}))
    results = parallel_launch(n, WORKER, ["dptp"], env=env, timeout_s=300, fail_fast_s=30, **_layout(n))
    with capsys.disabled():
        for r in results:
            print(f"\n[{label}] rank {r.rank}: " + "; ".join(r.lines("RESULT ")))
    assert all(r.ok for r in results), format_failures(results)
    want = {f"dptp_ag_{m}" for m in ("push", "ring", "all_peer")} | {
        f"dptp_rs_{m}" for m in ("ring", "pipeline", "chain", "columns")
    }
    for r in results:
        assert want <= {ln.split()[0] for ln in r.lines("RESULT ")}, format_failures(results)
    return results


def test_tp_within_hosts_dp_across_hosts_keeps_ipc(capsys):
    """The common multi-host layout: dp=2 across two "hosts", each TP group inside one host.
    transport='auto' keeps CUDA IPC (no group spans hosts), and every method of both ops is right
    in each group."""
    hosts = _two_hosts(4)
    results = _dp_by_tp(capsys, 4, "dp2 x tp2, two hosts", "auto", {"JAX_UB_TEST_HOSTS": hosts})
    for r in results:
        assert r.lines("RESULT transport ") == ["ipc bootstrap kv"], format_failures(results)
        assert r.lines("RESULT hosts ") == [hosts]


@pytest.mark.parametrize("n", [4, 8], ids=["dp2xtp2", "dp2xtp4"])
def test_dp_by_tp_mesh(capsys, n):
    """dp=2 x tp=n/2 over n processes: two communicator groups built across processes."""
    _dp_by_tp(capsys, n, f"dp2 x tp{n // 2}")


def _print_results(capsys, results, width: int, label: str = "") -> None:
    """Each rank's RESULT lines (cut at ``width`` characters), shown past pytest's capture."""
    with capsys.disabled():
        for r in results:
            print(f"\n{label}rank {r.rank} rc={r.returncode}: " + "; ".join(r.lines("RESULT "))[:width])


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_failed_op_refused_or_abandoned(capsys, transport):
    """An op refused on every rank before it begins leaves the communicators usable; an op that
    fails on one rank after it began fails there with its own cause, and the peers waiting for it
    time out naming that rank (ipc) or the NCCL ranks (nccl), within JAX_UB_TIMEOUT."""
    n, timeout = _world(4), 8
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT=transport)
    results = parallel_launch(n, WORKER, ["fault"], env=env, timeout_s=180, **_layout(n))
    _print_results(capsys, results, 900, f"[{transport}] ")
    for r in results:
        assert r.ok, format_failures(results)  # exit 0, in time
        assert r.lines("RESULT refused ") == ["True"], format_failures(results)
        assert r.lines("RESULT refused_comm_errors ") == ["0"], format_failures(results)
        assert float(r.lines("RESULT fault_after_refusal ")[0]) <= 1e-2, format_failures(results)
        failed = r.lines("RESULT abandoned_failed_after ")
        assert failed and float(failed[0]) <= timeout + 15, format_failures(results)
        errs = r.lines("RESULT abandoned_comm_errors ")[0]
        if r.rank == n - 1:
            assert "injected failure after the op began" in errs, errs
            assert "failed after it started" in errs, errs
        elif transport == "ipc":
            assert f"waiting for rank {n - 1}" in errs, errs
        else:
            assert "in NCCL send/recv with ranks" in errs, errs


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_missing_peer_times_out_with_a_clear_error(capsys, transport):
    n = _world(4)
    _missing_peer(capsys, n, transport, **_layout(n))


def test_nccl_timeout_fails_the_op_even_if_the_poison_word_never_lands(capsys):
    """Transport nccl: the watchdog's poison copy never reaches the GPU (test hook), so the abort
    comes from its 2 s fallback and the op's check finds the poison word clear. The op must
    still fail, through the abort mark the watchdog stores in host-mapped memory before the abort,
    instead of returning what NCCL's aborted kernels left in the output."""
    n, timeout = 2, 6
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT="nccl")
    results = parallel_launch(n, WORKER, ["nopoison"], env=env, timeout_s=120, **_layout(n))
    _print_results(capsys, results, 700)
    r0 = results[0]
    assert not r0.timed_out and r0.returncode == 0, format_failures(results)
    assert not r0.lines("RESULT completed "), format_failures(results)
    failed = r0.lines("RESULT failed_after ")
    assert failed and float(failed[0]) <= timeout + 2 + 10, format_failures(results)
    assert "in NCCL send/recv with ranks 1" in r0.lines("RESULT comm_errors ")[0], r0.stdout


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_crashed_peer_fails_the_op_at_once(capsys, transport):
    """The last rank's process dies while the others wait in an op for its data. The op fails
    within seconds instead of after JAX_UB_TIMEOUT: with ipc the watchdog sees in /proc that the
    awaited peer's process is gone; with nccl, NCCL notices the closed connection
    (ncclCommGetAsyncError, polled by the watchdog)."""
    n, timeout = 2, 60
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT=transport)
    results = parallel_launch(n, WORKER, ["crash"], env=env, timeout_s=150, **_layout(n))
    _print_results(capsys, results, 900, f"[{transport}] ")
    assert results[-1].returncode == 17 and results[-1].lines("RESULT crashing ") == ["1"], format_failures(
        results
    )
    for r in results[:-1]:
        assert not r.timed_out and r.returncode == 0, format_failures(results)
        failed = r.lines("RESULT failed_after ")
        assert failed, "the call did not fail: " + format_failures(results)
        assert float(failed[0]) < timeout / 3, failed  # at once, not at the timeout
        errs = r.lines("RESULT comm_errors ")[0]
        if transport == "ipc":
            assert f"rank {n - 1}'s process (pid " in errs and ") has exited" in errs, errs
            assert "the op was failed at once instead of after JAX_UB_TIMEOUT" in errs, errs
        else:
            assert "NCCL failed while this op (epoch" in errs, errs
            assert "ncclCommGetAsyncError" in errs, errs
        assert "timed out" not in errs, errs


@pytest.mark.parametrize("transport,on_stall", [("ipc", "abort"), ("nccl", "abort"), ("ipc", "wait")])
def test_stalled_watchdog_still_reports_then_aborts(capsys, transport, on_stall):
    """Rank 0's watchdog reader is made to sit as if blocked inside a CUDA call (what a stalled
    hardware queue with a full command buffer does to any enqueue) while the last rank never runs
    the op. The judge, which makes no CUDA call, must still report the timeout naming the missing
    rank, then report that its release cannot reach the GPU and abort the process (the default
    JAX_UB_ON_STALL=abort: a hang becomes a message and an exit code), or, with ``wait``, say so
    and leave the process running."""
    n, timeout = 2, 6
    grace = 10  # Communicator::kStallGraceS
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT=transport, JAX_UB_ON_STALL=on_stall)
    t0 = time.time()
    results = parallel_launch(
        n, WORKER, ["stall"], env=env, **_layout(n), timeout_s=180 if on_stall == "abort" else 50
    )
    r0 = results[0]
    with capsys.disabled():
        print(
            f"\n[{transport}, {on_stall}] rank 0 rc={r0.returncode} timed_out={r0.timed_out} after "
            f"{time.time() - t0:.1f} s; " + "; ".join(r0.lines("RESULT "))
        )
        for ln in r0.stderr.splitlines():
            if "timed out" in ln or "could not be released" in ln:
                print("rank 0 stderr: " + ln[:700])
    assert not r0.lines("RESULT failed_after ") and not r0.lines("RESULT completed ")
    if transport == "ipc":
        assert f"waiting for rank {n - 1}" in r0.stderr, format_failures(results)
    else:
        assert "in NCCL send/recv with ranks 1" in r0.stderr, format_failures(results)
    stall = [ln for ln in r0.stderr.splitlines() if "could not be released" in ln]
    assert len(stall) == 1, format_failures(results)
    assert "the watchdog's CUDA calls for device 0 have been blocked for" in stall[0], stall[0]
    overdue = float(stall[0].split("the watchdog asked ", 1)[1].split(" s ago", 1)[0])
    assert grace <= overdue < grace + 2, stall[0]
    if on_stall == "abort":
        assert not r0.timed_out, format_failures(results)
        assert r0.returncode == -signal.SIGABRT, format_failures(results)
        assert "Aborting the process (JAX_UB_ON_STALL=abort" in stall[0], stall[0]
        assert "First error: jax_ub all_gather_matmul" in stall[0], stall[0]
    else:  # still running when the launcher's bound ended it
        assert r0.timed_out, format_failures(results)
        assert "Leaving it waiting (JAX_UB_ON_STALL=wait)" in stall[0], stall[0]


def _launch_two(capsys, mode, env, timeout_s, width=900, **kw):
    """``mode`` of the worker on two ranks (sharing one GPU where there is one); prints each
    rank's results and returns them."""
    results = parallel_launch(2, WORKER, [mode], env=env, timeout_s=timeout_s, **_layout(2), **kw)
    _print_results(capsys, results, width)
    return results


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_busy_gpu_does_not_time_out_an_op_it_has_not_reached(capsys, transport):
    """The host enqueues an op while its GPU still has 3x JAX_UB_TIMEOUT of XLA work before it
    (async dispatch), on every rank: the watchdog times a wait (ipc) or an op (nccl) only once the
    GPU has reached the jax_ub op, so the op completes, right, with no error."""
    timeout = 5
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT=transport)
    results = _launch_two(capsys, "busy", env, 240, 700, fail_fast_s=30)
    assert all(r.ok for r in results), format_failures(results)
    for r in results:
        assert not r.lines("RESULT busy_failed "), format_failures(results)
        assert r.lines("RESULT busy_comm_errors ") == ["0"], format_failures(results)
        (timing,) = r.lines("RESULT busy_enqueued_s ")
        enqueued, done = float(timing.split()[0]), float(timing.split()[2])
        # The case only tests something if the op was enqueued well before the GPU reached it.
        assert enqueued < 1.0 and done - enqueued > 2 * timeout, timing


def test_refused_custom_call_empty_inner_dim_and_failed_growth(capsys):
    """Result types that do not match x (the FFI target called directly) are refused naming the
    shapes and dtypes, and leave the communicators usable; x[m, 0] @ w[0, n] gives zeros over
    NaN-poisoned memory; x @ w[k, 0] still returns the gathered x and leaves them usable; a jvp
    through method="ring" is refused naming the method (its custom_vjp is reverse mode only); a
    jax.vmap axis named like the TP axis runs XLA's collective (not the CUDA path); a buffer growth
    that cannot be allocated fails, and so does the next op, naming the allocation (not a vague "not
    connected")."""
    results = _launch_two(capsys, "checks", ENV, 180, fail_fast_s=30)
    assert all(r.ok for r in results), format_failures(results)
    for r in results:
        for name in ("bad_dtype", "jvp", "grow", "after_grow"):
            assert r.lines(f"RESULT checks_{name} ") == ["True"], (name, format_failures(results))
        assert r.lines("RESULT checks_empty_k_max ") == ["0.000e+00"], format_failures(results)
        assert r.lines("RESULT checks_empty_n_gathered ") == ["0.000e+00"], format_failures(results)
        assert float(r.lines("RESULT checks_vmap_axis ")[0]) < 1e-5, format_failures(results)
        assert r.lines("RESULT checks_comm_errors ") == ["0"], format_failures(results)


def test_ranks_running_different_ops_fail_naming_the_peer(capsys):
    """Rank 0 runs the ring AG->GEMM where its peer runs all_peer at the same epoch (a tuning file
    that differs between hosts would do that): the transfers complete, but the op check at the end
    of the call fails it on both ranks, naming the other rank and this rank's op, instead of
    returning data that may belong to another op."""
    results = _launch_two(capsys, "mismatch", dict(ENV, JAX_UB_TIMEOUT="20"), 180)
    for r in results:
        assert not r.timed_out, format_failures(results)
        assert float(r.lines("RESULT mismatch_warm ")[0]) < 1e-2, format_failures(results)
        assert not r.lines("RESULT mismatch_completed "), format_failures(results)
        assert r.lines("RESULT mismatch_failed_after "), format_failures(results)
        (errs,) = r.lines("RESULT mismatch_comm_errors ")
        other = 1 - r.rank
        assert f"rank {other} ran another op at epoch 2" in errs, errs
        assert f"all_gather_matmul algorithm {0 if r.rank == 0 else 1} bfloat16" in errs, errs
        assert f"rank {other} ran another op at epoch 2" in r.stderr, format_failures(results)


@pytest.mark.parametrize("late", ["host", "gpu"])
def test_a_rank_that_gave_up_fails_its_late_peers_op(capsys, late):
    """Rank 1 runs an op JAX_UB_TIMEOUT + 8 s late: its host sleeps first (``host``), or its GPU
    has that much XLA work before the op (``gpu``). Rank 0 times out waiting for it, and the
    released wait lets rank 0's push go on: it writes its shard into rank 1's buffer and signals
    it (a copy-engine copy cannot be stopped on the GPU). Rank 0 marks rank 1 failed before that
    release, so rank 1's op, which finds every signal it waits for, still fails, naming rank 0,
    instead of completing on data from a rank that gave up: before it begins where rank 1's
    watchdog saw the mark between ops (``host``: the CUDA context stays usable), at its end
    check on the GPU where the op was enqueued before the mark (``gpu``)."""
    timeout = 5
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TEST_LATE=late)
    r0, r1 = results = _launch_two(capsys, "gaveup", env, 150)
    for r in results:
        assert r.ok, format_failures(results)  # exit 0, in time
        assert float(r.lines("RESULT gaveup_warm ")[0]) < 1e-2, format_failures(results)
        assert not r.lines("RESULT gaveup_completed "), format_failures(results)
        assert r.lines("RESULT gaveup_failed_after "), format_failures(results)
    (errs0,) = r0.lines("RESULT gaveup_comm_errors ")
    # Its data-ready and buffer-free waits for rank 1 time out together; the first is reported.
    assert "timed out after" in errs0 and "waiting for rank 1 (" in errs0, errs0
    (errs1,) = r1.lines("RESULT gaveup_comm_errors ")
    assert "rank 0 gave up on this TP group" in errs1, errs1
    assert "timed out after" not in errs1, errs1  # not a timeout of its own
    (error1,) = r1.lines("RESULT gaveup_error ")
    if late == "host":
        assert "This rank's later ops fail before they begin" in errs1, errs1
        assert "rank 0 gave up on this TP group" in error1, error1  # the op's own error
        assert float(r1.lines("RESULT gaveup_failed_after ")[0]) < 1.0, format_failures(results)
        assert r1.lines("RESULT gaveup_context_ok ") == ["8.0"], format_failures(results)
    else:
        assert "CUDA" in error1, error1  # failed on the GPU


@pytest.mark.skipif(
    NGPU >= 4, reason="test_missing_peer_times_out_with_a_clear_error runs world 4 on this machine"
)
def test_missing_peer_at_world_four_on_fewer_gpus(capsys):
    _missing_peer(capsys, 4, "ipc", share_gpus=NGPU)


def _missing_peer(capsys, n, transport, **layout):
    timeout = 8
    env = dict(ENV, JAX_UB_TIMEOUT=str(timeout), JAX_UB_TRANSPORT=transport)
    results = parallel_launch(n, WORKER, ["timeout"], env=env, timeout_s=180, **layout)
    with capsys.disabled():
        for r in results:
            print(f"\nrank {r.rank} rc={r.returncode}: " + "; ".join(r.lines("RESULT "))[:600])
            tail = [ln for ln in r.stderr.splitlines() if "timed out" in ln]
            if tail:
                print(f"rank {r.rank} stderr: {tail[0]}")
    missing = n - 1
    for r in results[:-1]:
        assert not r.timed_out, format_failures(results)
        if transport == "ipc":
            assert f"waiting for rank {missing}" in r.stderr, format_failures(results)
            # How far this rank's own GPU got (the first op: no done-reading waits to pass).
            assert "XLA's stream had reached it: yes" in r.stderr, format_failures(results)
            assert "buffer-free signals) had run: yes" in r.stderr, format_failures(results)
        else:  # NCCL cannot tell which peer is missing: the message names them all
            assert "in NCCL send/recv with ranks" in r.stderr, format_failures(results)
            assert str(missing) in r.stderr.split("with ranks", 1)[1].split("(")[0]
        assert "epoch" in r.stderr and "all_gather_matmul" in r.stderr
        failed = r.lines("RESULT failed_after ")
        assert failed, "the call did not fail: " + format_failures(results)
        assert float(failed[0]) <= timeout + 5 + 10, failed  # + XLA's own error propagation


@pytest.mark.skipif(NGPU >= 8, reason="one process per GPU covers world 8 on this machine")
def test_missing_peer_at_world_eight_on_fewer_gpus(capsys):
    _missing_peer(capsys, 8, "ipc", share_gpus=NGPU)


def test_reinitialize_and_persistent_compilation_cache(capsys, tmp_path):
    """Across processes: a jit function traced under one communicator set runs on the set a later
    initialize() creates; an executable held across shutdown() fails on every rank naming the
    freed set (no hang) and leaves the new set usable. Launched twice on one
    JAX_COMPILATION_CACHE_DIR, the second launch loads the jax_ub programs (forward and gradient)
    from the persistent cache and computes the same bits."""
    n = _world(4)
    env = dict(
        ENV,
        JAX_UB_TIMEOUT="30",
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    runs = [
        parallel_launch(n, WORKER, ["lifecycle"], env=env, timeout_s=240, fail_fast_s=30, **_layout(n))
        for _ in range(2)
    ]
    with capsys.disabled():
        for i, results in enumerate(runs):
            for r in results:
                print(f"\n[launch {i}] rank {r.rank}: " + "; ".join(r.lines("RESULT ")))
    for results in runs:
        assert all(r.ok for r in results), format_failures(results)
        for r in results:
            for name in ("after_shutdown", "new_set", "held"):
                assert r.lines(f"RESULT lifecycle_{name} ") == ["True"], (name, format_failures(results))
            assert r.lines("RESULT lifecycle_comm_errors ") == ["0"], format_failures(results)

    def cache(r):  # (hits, misses) of one rank's launch
        ((hits, _, misses),) = (ln.split() for ln in r.lines("RESULT lifecycle_cache hits "))
        return int(hits), int(misses)

    # jax counts a miss where it writes an entry, and writes from process 0 only: the first
    # launch's misses are counted over all ranks.
    first_misses = sum(cache(r)[1] for r in runs[0])
    assert first_misses >= 3, [cache(r) for r in runs[0]]  # f, mlp, grad compiled and written
    assert sum(cache(r)[1] for r in runs[1]) < first_misses, [cache(r) for r in runs[1]]
    for first, second in zip(*runs, strict=True):
        assert cache(second)[0] >= 3, cache(second)  # every rank loads them in the second launch
        assert first.lines("RESULT lifecycle_digest ") == second.lines("RESULT lifecycle_digest ")
