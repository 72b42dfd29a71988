"""The measured rules behind method="auto" (no GPU needed): merged AG runs."""

from __future__ import annotations

import pytest

from jax_ub import config, overlap


@pytest.mark.parametrize(
    "world,n,itemsize,expected",
    [
        (4, 7168, 2, True),    # 8192,8192,28672 at tp 4 in bf16: chunks land within the GEMM
        (4, 2048, 2, False),   # 8192,8192,8192: the GEMM per chunk is shorter than the copies
        (4, 3072, 2, False),   # 16384,12288,12288
        (4, 7168, 4, False),   # float32: twice the bytes per chunk
        (2, 14336, 2, False),  # one peer chunk: nothing to merge
        (8, 14000, 2, True),
        (8, 13000, 2, False),
    ],
)
def test_merge_rule(world, n, itemsize, expected):
    assert overlap.merge_runs(world, n, itemsize) is expected


@pytest.mark.parametrize("mode,expected", [("on", True), ("off", False)])
def test_merge_forced_by_config(mode, expected):
    with config.override(ag_merge=mode):
        assert overlap.merge_runs(4, 8, 2) is expected
        assert overlap.merge_runs(4, 100000, 2) is expected
