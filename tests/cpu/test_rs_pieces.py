"""overlap.rs_pieces: how GEMM->RS splits its partials (sent to the kernel as splits/tail_pieces)."""

from __future__ import annotations

import pytest

from jax_ub import config, overlap

MIB = 1 << 20


@pytest.mark.parametrize("part,rows,want", [
    (112 * MIB, 2048, (1, 4)),   # 8192x8192x28672 tp4: whole peer partials, 4 tail pieces
    (96 * MIB, 4096, (1, 4)),    # 16384x12288x12288 tp4
    (32 * MIB, 2048, (2, 2)),    # 8192x8192x8192 tp4: two-piece partials, two tail pieces
    (28 * MIB, 512, (2, 2)),     # 2048x8192x28672 tp4
    (4 * MIB, 256, (1, 1)),      # small: one GEMM, one sum
    (100 * MIB, 6, (1, 3)),      # 4 pieces do not divide 6 rows: the next count that does
    (32 * MIB, 3, (1, 1)),       # odd rows: no halves, and 2 pieces do not divide 3
])
def test_auto_pieces(part, rows, want):
    with config.override(rs_tail_pieces=0):
        assert overlap.rs_pieces(part, rows) == want


def test_knob_overrides_size_rule_and_stays_a_multiple_of_splits():
    with config.override(rs_tail_pieces=1):
        assert overlap.rs_pieces(112 * MIB, 2048) == (1, 1)
    with config.override(rs_tail_pieces=8):
        assert overlap.rs_pieces(4 * MIB, 256) == (1, 8)
    with config.override(rs_tail_pieces=3):
        assert overlap.rs_pieces(32 * MIB, 2048) == (2, 2)  # 3 is not a multiple of splits=2
