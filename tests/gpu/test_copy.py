"""Single-GPU tier: the bounded-block copy kernel (csrc/kernels/copy.cu) that moves the local
chunk, received pieces and bulk all-gather copies beside a running GEMM.

A copy picks the widest unit in which both pointers are misaligned alike (16 bytes: bulk TMA or
vector loads; 8, 4, 2, 1) and copies the bytes before and after it one by one. Every
(destination, source) misalignment pair is checked here against a random source, with the
destination poisoned around the copied range: every byte of the range must match and no byte
outside it may change. Skipped without a GPU; fails where the extension is missing on a GPU machine.
"""

from __future__ import annotations

import itertools

import pytest

from tests._gpus import extension

pytestmark = pytest.mark.gpu  # tests/conftest.py skips it without a GPU


def _check(nbytes: int, dst_off: int, src_off: int, blocks: int) -> None:
    wrong, outside = extension("copy_check").copy_check(0, nbytes, dst_off, src_off, blocks)
    assert (wrong, outside) == (0, 0), (
        f"{nbytes} bytes, dst +{dst_off}, src +{src_off}, {blocks} blocks: {wrong} wrong, "
        f"{outside} changed outside"
    )


@pytest.mark.parametrize("nbytes", [1, 5, 15, 16, 33, 4099])
def test_every_misalignment_pair_copies_exactly_its_range(nbytes):
    for dst_off, src_off in itertools.product(range(16), repeat=2):
        _check(nbytes, dst_off, src_off, blocks=2)


@pytest.mark.parametrize(
    "dst_off,src_off", [(0, 0), (8, 0), (4, 12), (2, 0), (1, 0), (7, 7), (3, 11)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("nbytes", [(1 << 20) + 3, (24 << 20) + 10])
@pytest.mark.parametrize("blocks", [1, 8])
def test_large_copies_at_each_unit(nbytes, dst_off, src_off, blocks):
    """1 and 24 MiB (more tiles than blocks: each block loops) at units 16, 8, 4, 2, 1 and an
    equal misalignment (head and tail bytes around 16-byte units)."""
    _check(nbytes, dst_off, src_off, blocks)


def test_offsets_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"offsets must be in \[0, 15\]; got 16, 0"):
        extension("copy_check").copy_check(0, 16, 16, 0, 1)
