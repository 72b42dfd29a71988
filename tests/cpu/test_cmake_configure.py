"""CMakeLists.txt's build decisions, by running CMake's configure step (no compilation): a wrong
JAX_UB_CUDA_ARCHS names the knob; a build directory configured once without nvcc finds it later
(editable and --no-build-isolation installs keep CMake's cache); a bad CUDACXX is named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
)

pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake on PATH")


def _configure(build: Path, **env) -> subprocess.CompletedProcess:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CUDACXX", "JAX_UB_CUDA_ARCHS", "JAX_UB_REQUIRE_CUDA")
    }
    full.update(env)
    return subprocess.run(
        [CMAKE, "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def _flat(p: subprocess.CompletedProcess) -> str:
    return " ".join((p.stdout + p.stderr).split())  # CMake wraps its messages


@pytest.mark.parametrize("archs", ["sm_90", "75", "80,90"])
def test_a_wrong_arch_list_names_the_knob(tmp_path, archs):
    p = _configure(tmp_path / "b", JAX_UB_CUDA_ARCHS=archs)
    assert p.returncode != 0
    assert f'JAX_UB_CUDA_ARCHS="{archs}"' in _flat(p) and "compute capability of 80 or more" in _flat(p), (
        _flat(p)
    )


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (/usr/local/cuda/bin or PATH)")
def test_a_cached_missing_nvcc_is_looked_up_again(tmp_path):
    build = tmp_path / "b"
    first = _configure(build, CUDACXX="/nonexistent/nvcc")
    assert first.returncode == 0, _flat(first)
    assert "CUDACXX=/nonexistent/nvcc is not a working nvcc" in _flat(first)
    path = os.path.dirname(NVCC) + os.pathsep + os.environ.get("PATH", "")
    again = _configure(build, PATH=path)  # the same build directory, nvcc now on PATH
    # Found and enabled (the configure may stop later where nanobind is not installed: CI's venv
    # builds in pip's isolated environment).
    assert "The CUDA compiler identification is NVIDIA" in _flat(again), _flat(again)
    assert "installing without the CUDA extension" not in _flat(again), _flat(again)


def _wheel_layout(root: Path, toolkit: Path) -> Path:
    """A CUDA toolkit laid out as the nvidia-cuda-nvcc wheels lay it out (bin/, include/, nvvm/,
    and the libraries in lib/, no lib64/), by links into a real toolkit."""
    (root / "bin").mkdir(parents=True)
    for f in (toolkit / "bin").iterdir():
        (root / "bin" / f.name).symlink_to(f)
    (root / "include").symlink_to(toolkit / "include")
    (root / "nvvm").symlink_to(toolkit / "nvvm")
    (root / "lib").mkdir()
    for lib in ("libcudart_static.a", "libcudadevrt.a"):
        (root / "lib" / lib).symlink_to(toolkit / "lib64" / lib)
    so = sorted((toolkit / "lib64").glob("libcudart.so.[0-9]*"))[0]  # the wheels ship no libcudart.so
    (root / "lib" / f"libcudart.so.{so.name.split('.')[2]}").symlink_to(so)
    return root / "bin" / "nvcc"


# A toolkit with the usual layout (bin/nvcc, lib64/), to lay out as the wheels do.
TOOLKIT = next(
    (
        root
        for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda")
        if root
        and (Path(root) / "lib64" / "libcudart_static.a").exists()
        and (Path(root) / "bin" / "nvcc").exists()
    ),
    None,
)


@pytest.mark.skipif(TOOLKIT is None, reason="needs a CUDA toolkit ($CUDA_HOME or /usr/local/cuda)")
def test_nvcc_from_the_compiler_wheels_is_found_with_its_libraries(tmp_path):
    nvcc = _wheel_layout(tmp_path / "cu13", Path(str(TOOLKIT)).resolve())
    p = _configure(tmp_path / "b", CUDACXX=str(nvcc))
    assert f"jax_ub: nvcc from the nvidia-cuda-nvcc wheels ({tmp_path / 'cu13'})" in _flat(p), _flat(p)
    assert "The CUDA compiler identification is NVIDIA" in _flat(p), _flat(p)
    assert "installing without the CUDA extension" not in _flat(p), _flat(p)
    # FindCUDAToolkit passed (with the wheel's libcudart.so.N) and found the static runtime there.
    assert "jax_ub: XLA FFI headers" in _flat(p), _flat(p)
    cache = (tmp_path / "b" / "CMakeCache.txt").read_text()
    assert f"CUDA_cudart_static_LIBRARY:FILEPATH={tmp_path / 'cu13' / 'lib' / 'libcudart_static.a'}" in cache


def test_an_nvcc_that_does_not_run_is_reported_not_enabled(tmp_path):
    # A wrapper left behind by a removed toolkit: the install goes on without the extension, saying
    # which nvcc failed, instead of stopping in CMake's enable_language.
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nexec /nonexistent/cuda/bin/nvcc "$@"\n')
    fake.chmod(0o755)
    p = _configure(tmp_path / "b", PATH=f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert p.returncode == 0, _flat(p)
    assert f"{fake} was found but `nvcc --version` fails there" in _flat(p), _flat(p)
    assert "installing without the CUDA extension" in _flat(p), _flat(p)
