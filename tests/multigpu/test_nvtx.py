"""NVTX ranges on the CUDA path (csrc/common/nvtx.h): with an NVTX tool attached, every op opens a
range in the ``jax_ub`` domain named after it, and inside it one range per chunk GEMM (payload:
the chunk's source rank) and per chunk copy; every range is closed on the thread that opened it.

The tool is tests/gpu/_nvtx_recorder.c, a minimal NVTX injection library compiled here with the
system C compiler and loaded through ``NVTX_INJECTION64_PATH`` (what Nsight Systems does), which
logs each push and pop. Two ranks share a GPU where there is only one. Skips without a CUDA GPU.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests._gpus import driver_gpus
from tests.launcher import format_failures, parallel_launch

HERE = Path(__file__).parent
WORKER = HERE / "_nvtx_worker.py"
RECORDER = HERE.parent / "gpu" / "_nvtx_recorder.c"
NGPU = driver_gpus()
pytestmark = pytest.mark.gpu


def _cuda_include() -> Path:
    for root in (Path(sys.prefix) / "include", Path("/usr/local/cuda/include")):
        if (root / "nvtx3" / "nvToolsExt.h").exists():
            return root
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent / "include"
        if (root / "nvtx3" / "nvToolsExt.h").exists():
            return root
    pytest.fail("no nvtx3/nvToolsExt.h found (CUDA toolkit include directory)")


def _parse(path: Path) -> tuple[list[tuple[str, int, str]], dict[str, int]]:
    """(jax_ub's events as (kind, payload, name) per thread in order, unbalanced depth per thread)."""
    lines = path.read_text().splitlines()
    handles = {ln.split()[2] for ln in lines if ln.startswith("create jax_ub ")}
    assert len(handles) == 1, f"{path.name}: the jax_ub domain was created {len(handles)} times"
    (h,) = handles
    events: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for ln in lines:
        parts = ln.split(" ", 4)
        if parts[0] == "push" and parts[2] == h:
            events[parts[1]].append(("push", int(parts[3]), parts[4]))
        elif parts[0] == "pop" and parts[2] == h:
            events[parts[1]].append(("pop", -1, ""))
    return [e for evs in events.values() for e in evs], {
        t: sum(1 if k == "push" else -1 for k, _, _ in evs) for t, evs in events.items()
    }


def test_ops_and_chunks_open_nvtx_ranges(tmp_path):
    import jax_ub

    if not jax_ub.build_info().get("ext_nvtx"):
        pytest.fail(f"the extension was built without NVTX: {jax_ub.build_info()}")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler to build the NVTX recorder")
    lib = tmp_path / "nvtx_recorder.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", f"-I{_cuda_include()}", "-o", str(lib), str(RECORDER), "-lpthread"],
        check=True,
        timeout=120,
    )
    n = 2
    layout = dict(devices_per_proc=1) if n <= NGPU else dict(share_gpus=NGPU)
    env = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "JAX_UB_TIMEOUT": "60",
        "JAX_UB_TRANSPORT": "ipc",
        "NVTX_INJECTION64_PATH": str(lib),
        "JAX_UB_NVTX_LOG": str(tmp_path / "nvtx"),
    }
    results = parallel_launch(n, WORKER, [], env=env, timeout_s=240, fail_fast_s=30, **layout)
    assert all(r.ok for r in results), format_failures(results)
    logs = sorted(tmp_path.glob("nvtx.*"))
    assert len(logs) == n, f"expected one NVTX log per rank, got {[p.name for p in logs]}"
    for path in logs:
        events, depth = _parse(path)
        assert depth and all(d == 0 for d in depth.values()), f"{path.name}: unbalanced ranges {depth}"
        names = [name for kind, _, name in events if kind == "push"]
        for op in ("all_gather_matmul", "matmul_reduce_scatter"):
            assert op in names, f"{path.name}: no {op} range among {sorted(set(names))}"
        # The all-gather op's GEMM ranges: one per source rank, nested in the op's range.
        depth_now, in_ag, gemm_ranks, copies = 0, False, set(), 0
        for kind, payload, name in events:
            if kind == "push":
                depth_now += 1
                if name == "all_gather_matmul" and depth_now == 1:
                    in_ag = True
                elif in_ag and depth_now == 2 and name == "gemm":
                    gemm_ranks.add(payload)
                elif in_ag and depth_now == 2 and "copy" in name:
                    copies += 1
            else:
                depth_now -= 1
                if depth_now == 0 and in_ag:
                    break
        assert gemm_ranks == set(range(n)), f"{path.name}: GEMM ranges for chunks {sorted(gemm_ranks)}"
        assert copies >= n - 1, f"{path.name}: {copies} copy ranges in all_gather_matmul"
        print(
            f"\n{path.name}: {len(names)} jax_ub ranges; all_gather_matmul GEMM chunks {sorted(gemm_ranks)}"
        )
