"""The FP8 forms of the overlap ops across processes: every all-gather and reduce-scatter schedule
on float8 operands with per-tensor scales (bfloat16 and float32 results), each rank's output
against the float64 product of the dequantized operands, element by element
(tests/multigpu/_fp8_worker.py). The all-gather moves float8 bytes: the gathered x is checked bit
for bit.

Where there are fewer GPUs than ranks, the processes share a GPU (CUDA IPC works between
processes on one GPU): correctness only. Skips without a CUDA GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._gpus import driver_gpus
from tests.launcher import format_failures, parallel_launch

WORKER = Path(__file__).with_name("_fp8_worker.py")
NGPU = driver_gpus()
pytestmark = pytest.mark.gpu  # ranks share one GPU where that is all there is
ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_UB_TIMEOUT": "60"}


@pytest.mark.parametrize("transport", ["ipc", "nccl"])
def test_fp8_overlap_ops_every_schedule(capsys, transport):
    n = max(2, min(NGPU, 4))
    layout = dict(devices_per_proc=1) if n <= NGPU else dict(share_gpus=NGPU)
    env = dict(ENV, JAX_UB_BOOTSTRAP="kv", JAX_UB_TRANSPORT=transport)
    results = parallel_launch(n, WORKER, [], env=env, timeout_s=300, fail_fast_s=30, **layout)
    with capsys.disabled():
        for r in results:
            print(f"\n[fp8 {transport}, {n} ranks] rank {r.rank}: " + "; ".join(r.lines("RESULT ")))
    assert all(r.ok for r in results), format_failures(results)
    for r in results:
        names = {ln.split()[0] for ln in r.lines("RESULT ")}
        assert "fp8_public_all_gather_matmul_ring" in names
        assert {
            "fp8_ag_ring_bfloat16",
            "fp8_ag_ring_float32",
            "fp8_rs_ring_bfloat16",
            "fp8_rs_ring_float32",
        } <= names
        if transport == "ipc":
            assert {
                "fp8_rs_chain_cols_float32",
                "fp8_rs_columns_bfloat16",
                "fp8_ag_push_merge_float32",
            } <= names
