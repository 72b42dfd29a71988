"""Host-side planning of the CUDA overlap ops (no GPU needed, :mod:`jax_ub.schedule`): pieces of a
GEMM->RS and of the push AG->GEMM's last chunk, the bulk ops' side rows."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_ub import _ffi, config, methods, schedule


def test_chain_pieces_default_and_override():
    assert schedule.rs_splits("chain", 2048, 28672, 2) == schedule.RS_CHAIN_PIECES
    with config.override(rs_chain_pieces=4):
        assert schedule.rs_splits("chain", 2048, 28672, 2) == 4
    with config.override(rs_chain_pieces=1):
        assert schedule.rs_splits("chain", 2048, 28672, 2) == 1


@pytest.mark.parametrize("rows,want", [(2048, 4), (2046, 3), (2045, 1), (1022, 2)])
def test_chain_pieces_divide_the_rows(rows, want):
    """Pieces must split a rank's output rows evenly: the largest count <= the setting that does."""
    with config.override(rs_chain_pieces=4):
        got = schedule.rs_splits("chain", rows, 1024, 2)
    assert got == want and rows % got == 0


@pytest.mark.parametrize("method", ["ring", "pipeline"])
def test_ring_splits_by_partial_size(method):
    """ring/pipeline split a partial in two only inside RS_SPLIT_BYTES (measured on 4xH200)."""
    lo, hi = schedule.RS_SPLIT_BYTES
    n = 1024
    rows_in = (lo // (n * 2) + 2) // 2 * 2  # just above the lower bound, even
    assert schedule.rs_splits(method, rows_in, n, 2) == 2
    assert schedule.rs_splits(method, rows_in + 1, n, 2) == 1  # odd rows stay whole
    assert schedule.rs_splits(method, hi // (n * 2), n, 2) == 1  # at the upper bound: whole
    assert schedule.rs_splits(method, 8, n, 2) == 1


@pytest.mark.parametrize("method", ["ring", "pipeline"])
def test_ring_splits_only_where_the_copy_is_not_hidden(method):
    """Inside RS_SPLIT_BYTES, a partial is split only when its copy takes at least
    RS_SPLIT_MIN_COPY of its GEMM: a shorter copy hides under the next chunk's GEMM whole.
    The measured cases: tp 4 (k 2048) 2048,8192,28672 and 8192,8192,8192 split (0.535 -> 0.501,
    0.554 -> 0.519 ms); tp 2 (k 4096) 2048,8192,28672 whole (0.832 against 0.876 ms split)."""
    assert schedule.rs_splits(method, 512, 28672, 2, k=2048) == 2
    assert schedule.rs_splits(method, 2048, 8192, 2, k=2048) == 2
    assert schedule.rs_splits(method, 1024, 28672, 2, k=4096) == 1
    assert schedule.rs_splits(method, 1024, 28672, 2) == 2  # k unknown: the size rule alone
    # float32 GEMMs run at a quarter of the rate: the copy is short beside them at any k here
    assert schedule.rs_splits(method, 512, 8192, 4, k=2048) == 1
    # the ratio does not depend on rows or n: where k makes the copy long enough, sizes decide
    lo = schedule.RS_SPLIT_BYTES[0]
    assert schedule.rs_splits(method, lo // (4096 * 2) + 2, 4096, 2, k=1024) == 2


def test_chain_column_pieces_need_aligned_equal_blocks():
    """Column pieces only where n splits into equal 16-byte blocks; ``rows`` always refuses;
    ``auto`` takes columns up to RS_CHAIN_COLS_MAX_N."""
    with config.override(rs_chain_split="cols"):
        assert schedule.rs_chain_cols(2, 28672, 2)
        assert not schedule.rs_chain_cols(1, 28672, 2)  # one piece: nothing to split
        assert not schedule.rs_chain_cols(3, 1000, 2)  # 1000 % 3 != 0
        assert not schedule.rs_chain_cols(4, 1000, 2)  # 250 * 2 bytes: not 16-byte blocks
        assert schedule.rs_chain_cols(4, 1024, 4)
    with config.override(rs_chain_split="rows"):
        assert not schedule.rs_chain_cols(2, 4096, 2)
    with config.override(rs_chain_split="auto"):
        lim = schedule.RS_CHAIN_COLS_MAX_N
        assert schedule.rs_chain_cols(2, lim, 2)
        assert schedule.rs_chain_cols(2, 1024, 2)
        assert not schedule.rs_chain_cols(2, lim + 16, 2)
        assert not schedule.rs_chain_cols(2, 28672, 2)
        assert not schedule.rs_chain_cols(4, 1000, 2)  # narrow but not 16-byte blocks: rows


def test_ag_push_pieces_rule_and_override():
    """The push's last chunk goes in pieces where the schedule model says the op ends >= 5%
    sooner: comm-bound chunks (copy longer than the chunk's GEMM) of GEMMs long enough to split;
    other algorithms never; an override wins; the count divides the local rows."""
    # (rows, n, k) at tp 2, bf16: measured best on 2xH200 (lab-2026-11:scripts/piece_probe.py).
    assert schedule.ag_push_pieces("push", 8192, 1024, 8192, 2, 2) == 4  # 16384,8192,2048
    assert schedule.ag_push_pieces("push", 4096, 1024, 8192, 2, 2) == 2  # 8192,8192,2048
    assert schedule.ag_push_pieces("push", 8192, 2048, 8192, 2, 2) == 1  # 16384,8192,4096: GEMM-bound
    assert schedule.ag_push_pieces("push", 8192, 512, 4096, 2, 2) == 1  # tiny GEMMs: no gain
    assert schedule.ag_push_pieces("push", 4096, 4096, 8192, 2, 2) == 1  # 8192,8192,8192
    # The tp-4 bench shapes: GEMM-bound or balanced chunks, one piece.
    for M, K, N in ((8192, 8192, 28672), (8192, 8192, 8192), (16384, 12288, 12288), (2048, 8192, 28672)):
        assert schedule.ag_push_pieces("push", M // 4, N // 4, K, 2, 4) == 1
    assert schedule.ag_push_pieces("ring", 8192, 1024, 8192, 2, 2) == 1
    assert schedule.ag_push_pieces("push", 8194, 1024, 8192, 2, 2) == 2  # 4 and 3 do not divide 8194
    with config.override(ag_push_pieces=4):
        assert schedule.ag_push_pieces("push", 2048, 8192, 1024, 2, 4) == 4
        assert schedule.ag_push_pieces("ring", 2048, 8192, 1024, 2, 4) == 1
    with config.override(ag_push_pieces=3):
        assert schedule.ag_push_pieces("push", 2048, 8192, 1024, 2, 4) == 2  # 3 does not divide 2048
        assert schedule.ag_push_pieces("chain", 2046, 8192, 1024, 2, 4) == 3


def test_ag_push_merge_is_opt_in_for_push_without_pieces():
    """The peers' chunks in at most two GEMMs: only when asked for, with the push algorithm (also
    the AG side of chain/columns), without pieces, and with more than one peer."""
    assert not schedule.ag_push_merge("push", 4, 1)  # off by default
    with config.override(ag_push_merge=True):
        assert schedule.ag_push_merge("push", 4, 1)
        assert schedule.ag_push_merge("chain", 8, 1)
        assert not schedule.ag_push_merge("push", 4, 2)  # pieces: the last chunk goes in pieces
        assert not schedule.ag_push_merge("push", 2, 1)  # one peer chunk: nothing to merge
        assert not schedule.ag_push_merge("ring", 4, 1)
        assert not schedule.ag_push_merge("all_peer", 4, 1)


def test_method_push_merge_is_push_with_merged_peer_chunks():
    """method="push_merge" merges without the knob, asks for no pieces (where push would take
    them), lands the peers' shards by push like push, and is ring for the reduce-scatter."""
    assert schedule.ag_push_merge("push_merge", 4, 1) and schedule.ag_push_merge("push_merge", 8, 1)
    assert not schedule.ag_push_merge("push_merge", 2, 1)  # one peer chunk: it is push
    # chunks whose copy outlasts their GEMM (16384,8192,2048 at tp 2): push takes pieces, push_merge none
    assert schedule.ag_push_pieces("push", 8192, 1024, 8192, 2, 2) == 4
    assert schedule.ag_push_pieces("push_merge", 8192, 1024, 8192, 2, 2) == 1
    with config.override(ag_push_pieces=4):
        assert schedule.ag_push_pieces("push_merge", 2048, 8192, 1024, 2, 4) == 1
    assert methods.runs(methods.AG, "push_merge") == "push_merge"
    assert methods.runs(methods.RS, "push_merge") == "ring"
    assert (
        methods.runs(methods.BULK_AG, "push_merge")
        == methods.runs(methods.ALL_GATHER, "push_merge")
        == "push"
    )


@pytest.mark.parametrize(
    "n,itemsize,want", [(28672, 2, 4), (1000, 2, 5), (784, 2, 2), (1001, 4, 1), (1000, 4, 5)]
)
def test_column_blocks_are_equal_whole_vectors(n, itemsize, want):
    """columns cuts n into at most RS_COLUMN_PIECES equal blocks of whole 16-byte vectors, or
    keeps it whole where no such cut exists (1001 float32 columns)."""
    with config.override(rs_column_pieces=schedule.RS_COLUMN_PIECES if want != 5 else 8):
        got = schedule.rs_splits("columns", 512, n, itemsize)
    assert got == want and n % got == 0
    assert got == 1 or (n // got * itemsize) % 16 == 0


def test_bulk_side_rows_cover_the_copies():
    # All-gather: the GEMM's first rows leave bulk_copy_sms SMs to the shard's two copies, for
    # about as long as the estimate says those copies take (multiples of 128 rows, at most all).
    shard = 2048 * 8192 * 2  # bf16 x shard of bench bulk_ag 8192^3 at tp 4
    assert config.get().bulk_copy_sms > 0
    with config.override(bulk_copy_sms=16):
        sms, rows = schedule.bulk_side(0, shard, 8192, 2048, 8192, jnp.bfloat16)
    assert sms == 16
    t_copy = 2 * shard / (sms * schedule.BULK_COPY_GBPS_PER_SM * 1e9)
    t_rows = rows * 2 * 2048 * 8192 / (schedule.GEMM_TFLOPS * 1e12)
    assert rows % 128 == 0 and 0 < rows < 8192
    assert schedule.BULK_SIDE_MARGIN * t_copy <= t_rows
    assert t_rows < schedule.BULK_SIDE_MARGIN * t_copy + 128 * 2 * 2048 * 8192 / (schedule.GEMM_TFLOPS * 1e12)
    # A GEMM shorter than the copies runs whole beside them; a tiny one still gets 128 rows or all.
    k = config.get().bulk_copy_sms
    assert schedule.bulk_side(0, shard, 1024, 256, 256, jnp.bfloat16) == (k, 1024)
    assert schedule.bulk_side(0, 64, 100, 8, 8, jnp.float32) == (k, 100)
    with config.override(bulk_copy_sms=0):
        assert schedule.bulk_side(0, shard, 8192, 2048, 8192, jnp.bfloat16) == (0, 0)
    # Reduce-scatter: bulk_reduce_sms, over the whole GEMM, or nothing.
    assert schedule.bulk_side(1, shard, 8192, 2048, 8192, jnp.bfloat16) == (0, 0)
    with config.override(bulk_reduce_sms=16):
        assert schedule.bulk_side(1, shard, 8192, 2048, 8192, jnp.bfloat16) == (16, 8192)


def test_rs_pieces_by_size_and_override():
    """The bare reduce-scatter's row pieces: one per RS_PIECE_BYTES of a peer's rows, at most
    RS_PIECES, never more than the rows; config.rs_pieces sets the count (still <= rows)."""
    mib = 1 << 20
    with config.override(rs_pieces=0):
        assert schedule.rs_pieces(4096, 4096 * 2) == 1  # 32 MiB: one piece
        assert schedule.rs_pieces(4096, 4096 * 2 - 2) == 1  # just under
        assert schedule.rs_pieces(2 * 4096, 4096 * 2) == 2  # 64 MiB
        assert schedule.rs_pieces(16384, 8192 * 2) == schedule.RS_PIECES  # 256 MiB: capped
        assert schedule.rs_pieces(3, 1024 * mib) == 3  # huge rows, 3 of them
        assert schedule.rs_pieces(128, 1000) == 1
    with config.override(rs_pieces=8):
        assert schedule.rs_pieces(1000, 10) == 8
        assert schedule.rs_pieces(5, 10) == 5
    with config.override(rs_pieces=1):
        assert schedule.rs_pieces(16384, 8192 * 2) == 1


_FAKE_ENUMS = {
    "ag_algorithm": {"ring": 10, "all_peer": 11, "push": 12},
    "rs_algorithm": {"ring": 20, "pipeline": 21, "chain": 22, "columns": 23},
    "bulk_kind": {"ag": 30, "rs": 31},
    "dtype": {"float32": 40, "float16": 41, "bfloat16": 42},
    "failure": {"none": 50, "before": 51},
}


def test_ffi_codes_come_from_the_extensions_enum_table(monkeypatch):
    """The integers of a CUDA call are the extension's (``_ext.enums()``, built from the C++ enums),
    not a copy: with a stand-in table every code is that table's value; push_merge is push's kernel."""
    from jax_ub import _ext

    monkeypatch.setattr(_ext, "enums", lambda: _FAKE_ENUMS)
    assert _ffi.schedule_code("ag", "push") == 12 and _ffi.schedule_code("ag", "push_merge") == 12
    assert _ffi.schedule_code("rs", "columns") == 23
    assert _ffi.dtype_code(jnp.bfloat16) == 42 and _ffi.bulk_kind_code("rs") == 31
    assert _ffi.failure_codes() == {"none": 50, "before": 51}
    with pytest.raises(
        ValueError, match=r"no rs schedule 'push'; have \['chain', 'columns', 'pipeline', 'ring'\]"
    ):
        _ffi.schedule_code("rs", "push")
    with pytest.raises(ValueError, match="no GEMM dtype code for int8"):
        _ffi.dtype_code(jnp.int8)
    with pytest.raises(ValueError, match="no collective 'xx'"):
        _ffi.schedule_code("xx", "ring")


def test_ffi_codes_without_the_extension_say_why(monkeypatch):
    from jax_ub import _ext

    monkeypatch.setattr(_ext, "_load", lambda: (None, "not built (no nvcc)"))
    with pytest.raises(RuntimeError, match=r"extension unavailable.*not built \(no nvcc\)"):
        _ffi.schedule_code("ag", "ring")
