"""Shared pytest setup for the three tiers (cpu, gpu, multigpu).

The CPU tier runs on 8 forced host devices, so this file sets ``XLA_FLAGS`` before anything imports
jax. It does not touch ``JAX_PLATFORMS``: the forced device count only affects the CPU platform, and
the CPU-tier meshes are built from ``jax.devices("cpu")``, so the same run also works on a GPU host.

Markers: ``gpu`` (needs one GPU) and ``multigpu`` (needs at least two). Such tests are skipped
where the machine lacks the GPUs (counted from the NVIDIA driver, not from jax), and fail where the
driver lists them but jax cannot use them (``--skip-gpu-tiers`` skips them on purpose). The
multi-process tier (tests/multigpu/test_multiprocess.py) is
marked ``gpu``: its ranks share a GPU where there are fewer GPUs than ranks.

Tests start child processes on the GPUs this process uses, so XLA's preallocation (75% of every
GPU's memory, taken when jax starts its GPU backend) is off by default here.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HOST_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"


def _with_host_devices(flags: str) -> str:
    """XLA_FLAGS with at least HOST_DEVICES host devices: a smaller count set by the user (4, as the
    README's CPU examples use) would silently skip every tp=8 and dp x tp = 8 case."""
    found = re.findall(rf"{_FLAG}=(\d+)", flags)
    if found and int(found[-1]) >= HOST_DEVICES:
        return flags
    flags = re.sub(rf"\s*{_FLAG}=\S*", "", flags)
    return f"{flags} {_FLAG}={HOST_DEVICES}".strip()


os.environ["XLA_FLAGS"] = _with_host_devices(os.environ.get("XLA_FLAGS", ""))

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # _gpus, however pytest was started
import _gpus  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-gpu-tiers",
        action="store_true",
        help="skip the gpu/multigpu tests even where the NVIDIA driver lists GPUs "
        "(by default they fail there when jax cannot use the GPUs)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs one NVIDIA GPU (skipped without)")
    config.addinivalue_line("markers", "multigpu: needs two or more NVIDIA GPUs (skipped without)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("multigpu")]
    if not wanted:
        return
    have = _gpus.driver_gpus()
    for item in wanted:
        need = 2 if item.get_closest_marker("multigpu") else 1
        if config.getoption("--skip-gpu-tiers"):
            item.add_marker(pytest.mark.skip(reason="--skip-gpu-tiers"))
        elif have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPU(s); the NVIDIA driver lists {have}"))
        elif why := _gpus.unusable(need):
            item.stash[_UNUSABLE] = why


_UNUSABLE = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if why := item.stash.get(_UNUSABLE, ""):
        pytest.fail(why, pytrace=False)


def _mesh(
    devices: list[jax.Device], shape: tuple[int, ...], names: tuple[str, ...], explicit: bool = False
) -> Mesh:
    n = int(np.prod(shape))
    if len(devices) < n:
        pytest.skip(f"mesh {dict(zip(names, shape, strict=True))} needs {n} devices; found {len(devices)}")
    kw = {}
    if hasattr(jax.sharding, "AxisType"):  # plain (Auto) meshes unless Explicit axes are asked for
        kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
        kw["axis_types"] = (kind,) * len(shape)
    return Mesh(np.array(devices[:n]).reshape(shape), names, **kw)


@pytest.fixture
def cpu_mesh():
    """``cpu_mesh(tp)`` -> 1-D mesh ``("tp",)``; ``cpu_mesh(tp, dp=2)`` -> ``("dp", "tp")``;
    ``cpu_mesh(tp, dp=2, tp_first=True)`` -> ``("tp", "dp")`` (TP groups strided in device ids);
    ``explicit=True``: every axis of type Explicit."""

    def make(tp: int, dp: int | None = None, tp_first: bool = False, explicit: bool = False) -> Mesh:
        devices = jax.devices("cpu")
        if dp is None:
            return _mesh(devices, (tp,), ("tp",), explicit)
        if tp_first:
            return _mesh(devices, (tp, dp), ("tp", "dp"), explicit)
        return _mesh(devices, (dp, tp), ("dp", "tp"), explicit)

    return make
