"""Host-side planning of the CUDA overlap ops (no GPU needed): row pieces of a GEMM->RS."""

from __future__ import annotations

import pytest

from jax_ub import config, overlap


def test_chain_pieces_default_and_override():
    assert overlap.rs_splits("chain", 2048, 28672, 2) == overlap.RS_CHAIN_PIECES
    with config.override(rs_chain_pieces=4):
        assert overlap.rs_splits("chain", 2048, 28672, 2) == 4
    with config.override(rs_chain_pieces=1):
        assert overlap.rs_splits("chain", 2048, 28672, 2) == 1


@pytest.mark.parametrize("rows,want", [(2048, 4), (2046, 3), (2045, 1), (1022, 2)])
def test_chain_pieces_divide_the_rows(rows, want):
    """Pieces must split a rank's output rows evenly: the largest count <= the setting that does."""
    with config.override(rs_chain_pieces=4):
        got = overlap.rs_splits("chain", rows, 1024, 2)
    assert got == want and rows % got == 0


@pytest.mark.parametrize("method", ["ring", "pipeline"])
def test_ring_splits_by_partial_size(method):
    """ring/pipeline split a partial in two only inside RS_SPLIT_BYTES (measured on 4xH200)."""
    lo, hi = overlap.RS_SPLIT_BYTES
    n = 1024
    rows_in = (lo // (n * 2) + 2) // 2 * 2  # just above the lower bound, even
    assert overlap.rs_splits(method, rows_in, n, 2) == 2
    assert overlap.rs_splits(method, rows_in + 1, n, 2) == 1  # odd rows stay whole
    assert overlap.rs_splits(method, hi // (n * 2), n, 2) == 1  # at the upper bound: whole
    assert overlap.rs_splits(method, 8, n, 2) == 1
