"""How many NVIDIA GPUs the test tiers may use, counted without jax.

The GPU tiers skip only where the machine lacks the GPUs. Where the driver lists them but jax
cannot use them (jax without its CUDA plugin, a plugin/jaxlib mismatch, a driver too old for the
plugin), the tests fail with jax's reason: a broken install must not look like a CPU machine.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path


def _visible(n: int) -> int:
    """``n`` driver GPUs as limited by CUDA_VISIBLE_DEVICES (CUDA stops at the first invalid entry)."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return n
    count = 0
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(n, count)


@functools.cache
def driver_gpus() -> int:
    """GPUs the NVIDIA driver lists (``nvidia-smi -L``, else /proc/driver/nvidia/gpus), as far as
    CUDA_VISIBLE_DEVICES lets this process see them; 0 without a driver."""
    n = 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            n = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass
    if n == 0:
        proc = Path("/proc/driver/nvidia/gpus")
        n = sum(1 for _ in proc.iterdir()) if proc.is_dir() else 0
    return _visible(n)


def jax_gpus() -> tuple[list, str]:
    """(jax's CUDA devices, why there are none)."""
    import jax

    try:
        return jax.devices("cuda"), ""
    except RuntimeError as err:
        return [], str(err)


def unusable(need: int) -> str:
    """Why a test that needs ``need`` GPUs must fail on this machine, or "" (it can run, or the
    machine lacks the GPUs and the test is skipped)."""
    have = driver_gpus()
    if have < need:
        return ""
    devices, err = jax_gpus()
    if len(devices) >= need:
        return ""
    return (
        f"the NVIDIA driver lists {have} GPU(s) here, but jax sees {len(devices)}"
        f"{f' ({err})' if err else ''}: install jax with its CUDA plugin (pip install "
        f"'.[cuda13]' or '.[cuda12]', matching the driver), or pass --skip-gpu-tiers to run "
        f"the CPU tier only"
    )


def extension(attr: str | None = None):
    """The jax_ub extension on a machine with GPUs, else the test fails: there, a missing
    extension (built without nvcc, failed to load) is a broken install, not a reason to skip."""
    import pytest

    from jax_ub import _ext

    mod = _ext.extension()
    if mod is None or (attr is not None and not hasattr(mod, attr)):
        import jax_ub

        info = jax_ub.build_info()
        pytest.fail(
            f"GPU present but the jax_ub extension{f' (with {attr})' if attr else ''} is not "
            f"loaded: {info.get('extension_error') or info['reason']}",
            pytrace=False,
        )
    return mod


def nccl():
    """Fail where NCCL cannot be loaded on a GPU machine (it ships with jax's CUDA wheels)."""
    import pytest

    extension()
    from jax_ub.comm import nccl as _nccl

    if err := _nccl.load_error():
        pytest.fail(f"GPU present but NCCL cannot be loaded: {err}", pytrace=False)
