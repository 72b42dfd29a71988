"""The build backend's decisions (build_backend/jax_ub_backend.py): which compiler wheels an install
asks for, which nvcc it builds with and whether the CUDA extension must build, for each kind of
machine (NVIDIA driver or none, a usable system nvcc or none, -C cuda=..., the opt-out)."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_backend():
    spec = importlib.util.spec_from_file_location(
        "jax_ub_backend", ROOT / "build_backend" / "jax_ub_backend.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


jb = _load_backend()


def machine(driver=None, nvcc=None, version=None, cudacxx=False, target=None, allow=False, require=False):
    return jb.Machine(
        driver=driver,
        nvcc=nvcc,
        nvcc_version=version,
        cudacxx=cudacxx,
        target=target,
        allow_no_cuda=allow,
        require_cuda=require,
    )


CU13_0 = (
    "nvidia-cuda-nvcc>=13.0,<13.1",
    "nvidia-cuda-crt>=13.0,<13.1",
    "nvidia-nvvm>=13.0,<13.1",
    "nvidia-cuda-cccl>=13.0,<13.1",
    "nvidia-cuda-runtime>=13.0,<13.1",
)


# ---- no NVIDIA driver: as a plain install always did ------------------------------------------


def test_no_driver_with_system_nvcc_downloads_nothing_and_keeps_the_users_require():
    # CI: a CPU machine with /usr/local/cuda's nvcc and JAX_UB_REQUIRE_CUDA=1.
    plan = jb.decide(machine(nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0), require=True))
    assert plan.requires == () and plan.wheel_nvcc is None and plan.require_cuda
    plan = jb.decide(machine(nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0)))
    assert plan.requires == () and not plan.require_cuda


def test_no_driver_and_no_nvcc_installs_the_reference_package():
    plan = jb.decide(machine())
    assert plan.requires == () and plan.wheel_nvcc is None and not plan.require_cuda
    assert "no NVIDIA driver" in plan.why


# ---- a driver: the extension must build ---------------------------------------------------------


def test_driver_without_nvcc_asks_for_the_compiler_wheels_no_newer_than_the_driver():
    plan = jb.decide(machine(driver=(13, 0)))
    assert plan.requires == CU13_0
    assert plan.wheel_nvcc == "nvidia/cu13/bin/nvcc" and plan.require_cuda
    assert "CUDA 13.0" in plan.why and "no system nvcc" in plan.why
    assert jb.decide(machine(driver=(13, 4))).requires[0] == "nvidia-cuda-nvcc>=13.0,<13.5"


def test_a_driver_newer_than_cuda_13_takes_any_cuda_13():
    assert jb.decide(machine(driver=(14, 1))).requires[0] == "nvidia-cuda-nvcc>=13.0,<14"


@pytest.mark.parametrize("driver,version", [((13, 0), (13, 0)), ((13, 2), (12, 8)), ((12, 4), (12, 4))])
def test_a_system_nvcc_the_driver_runs_is_used_without_download(driver, version):
    plan = jb.decide(machine(driver=driver, nvcc="/opt/cuda/bin/nvcc", version=version))
    assert plan.requires == () and plan.wheel_nvcc is None and plan.require_cuda
    assert "/opt/cuda/bin/nvcc" in plan.why


def test_a_system_nvcc_newer_than_the_driver_is_passed_over_for_the_wheels():
    plan = jb.decide(machine(driver=(13, 0), nvcc="/usr/bin/nvcc", version=(14, 0)))
    assert plan.requires == CU13_0 and "is CUDA 14.0" in plan.why


def test_a_broken_system_nvcc_is_passed_over_for_the_wheels():
    plan = jb.decide(machine(driver=(13, 0), nvcc="/usr/local/bin/nvcc", version=None))
    assert plan.requires == CU13_0


def test_cudacxx_is_the_users_choice():
    plan = jb.decide(machine(driver=(13, 0), nvcc="/x/nvcc", version=None, cudacxx=True))
    assert plan.requires == () and plan.require_cuda


def test_a_cuda_12_driver_without_a_cuda_12_nvcc_fails_with_the_reason():
    # The package index has no CUDA 12 nvcc; a CUDA 13 nvcc would build what this driver cannot run.
    with pytest.raises(jb.BuildError) as e:
        jb.decide(machine(driver=(12, 4), nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0)))
    msg = str(e.value)
    assert "the NVIDIA driver supports CUDA 12.4" in msg and "is CUDA 13.0" in msg
    assert "no CUDA 12 nvcc" in msg and "CUDACXX" in msg and "JAX_UB_ALLOW_NO_CUDA=1" in msg


def test_the_opt_out_installs_without_the_extension_instead_of_failing():
    plan = jb.decide(machine(driver=(12, 4), allow=True))
    assert plan.requires == () and not plan.require_cuda and "JAX_UB_ALLOW_NO_CUDA=1" in plan.why
    # Where the compiler wheels exist the build still tries, and may fail without failing the install.
    plan = jb.decide(machine(driver=(13, 0), allow=True))
    assert plan.requires == CU13_0 and not plan.require_cuda


def test_a_driver_older_than_cuda_12_fails_unless_opted_out():
    with pytest.raises(jb.BuildError, match=r"supports CUDA 11\.8; jax_ub needs CUDA >= 12"):
        jb.decide(machine(driver=(11, 8)))
    assert not jb.decide(machine(driver=(11, 8), allow=True)).require_cuda


# ---- -C cuda=... / JAX_UB_BUILD_CUDA ------------------------------------------------------------


def test_a_target_builds_without_a_driver():
    # A wheel built on a CPU machine for GPU machines.
    plan = jb.decide(machine(target="13"))
    assert plan.requires[0] == "nvidia-cuda-nvcc>=13.0,<14" and plan.require_cuda
    assert jb.decide(machine(target="13.0")).requires == CU13_0


def test_a_target_takes_a_system_nvcc_of_its_major_only():
    plan = jb.decide(machine(target="13", nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0)))
    assert plan.requires == ()
    plan = jb.decide(machine(target="13", nvcc="/usr/local/cuda/bin/nvcc", version=(12, 9)))
    assert plan.requires[0] == "nvidia-cuda-nvcc>=13.0,<14"
    with pytest.raises(jb.BuildError, match="no CUDA 12 nvcc"):
        jb.decide(machine(target="12", nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0)))
    assert jb.decide(machine(target="12", nvcc="/c12/bin/nvcc", version=(12, 6))).requires == ()


def test_a_target_newer_than_the_driver_is_refused():
    with pytest.raises(
        jb.BuildError, match=r"cuda=13 asks for CUDA 13, but the NVIDIA driver supports CUDA 12\.8"
    ):
        jb.decide(machine(target="13", driver=(12, 8)))


@pytest.mark.parametrize("target", ["sm_90", "13.x", "11", "14"])
def test_a_wrong_target_names_the_setting(target):
    with pytest.raises(jb.BuildError, match="cuda="):
        jb.decide(machine(target=target))


def test_the_target_comes_from_the_config_setting_or_the_variable():
    assert jb._target({"cuda": "13"}, {}) == "13"
    assert jb._target({"cuda": ["12", "13.0"]}, {}) == "13.0"
    assert jb._target(None, {"JAX_UB_BUILD_CUDA": "12"}) == "12"
    assert jb._target({"cuda": "auto"}, {}) is None and jb._target(None, {}) is None


# ---- the facts ----------------------------------------------------------------------------------


def _fake_nvcc(path: Path, release: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_system_nvcc_looks_where_cmake_looks(tmp_path):
    on_path = _fake_nvcc(tmp_path / "p" / "nvcc", "13.0")
    home = _fake_nvcc(tmp_path / "home" / "bin" / "nvcc", "12.6")
    assert jb.system_nvcc({"CUDACXX": "/x/nvcc", "PATH": str(on_path.parent)}) == ("/x/nvcc", True)
    assert jb.system_nvcc({"PATH": str(on_path.parent), "CUDA_HOME": str(home.parent.parent)}) == (
        str(on_path),
        False,
    )
    found, _ = jb.system_nvcc({"PATH": str(tmp_path), "CUDA_HOME": str(home.parent.parent)})
    assert found == str(home)
    assert jb.nvcc_version(str(on_path)) == (13, 0) and jb.nvcc_version(str(home)) == (12, 6)
    assert jb.nvcc_version(str(tmp_path / "none")) is None


def test_the_driver_version_comes_from_libcuda(monkeypatch):
    class Lib:
        def cuDriverGetVersion(self, ref):
            ref._obj.value = 13020
            return 0

    monkeypatch.setattr(jb.ctypes, "CDLL", lambda name: Lib())
    assert jb.driver_cuda_version() == (13, 2)

    def missing(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(jb.ctypes, "CDLL", missing)
    assert jb.driver_cuda_version() is None


def test_the_wheel_nvcc_is_found_on_sys_path(tmp_path):
    nvcc = _fake_nvcc(tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc", "13.0")
    assert jb.find_wheel_nvcc("nvidia/cu13/bin/nvcc", [str(tmp_path / "x"), str(tmp_path / "site")]) == str(
        nvcc
    )
    assert jb.find_wheel_nvcc("nvidia/cu13/bin/nvcc", [str(tmp_path)]) is None


# ---- the hooks ----------------------------------------------------------------------------------


def _on(monkeypatch, m):
    monkeypatch.setattr(jb, "machine", lambda config_settings=None, env=None: m)


def _skb(monkeypatch, **hooks):
    """scikit-build-core's backend replaced by ``hooks`` (CI's test venv does not install it)."""
    monkeypatch.setattr(jb, "_skbuild", lambda: types.SimpleNamespace(**hooks))


def test_get_requires_adds_the_compiler_wheels_to_scikit_build_cores(monkeypatch):
    seen = {}

    def skb(config_settings=None):
        seen["cs"] = config_settings
        return ["ninja"]

    _skb(monkeypatch, get_requires_for_build_wheel=skb)
    _on(monkeypatch, machine(driver=(13, 0)))
    assert jb.get_requires_for_build_wheel({"cuda": "13", "cmake.verbose": "true"}) == ["ninja", *CU13_0]
    assert seen["cs"] == {"cmake.verbose": "true"}  # scikit-build-core refuses keys it does not know
    _on(monkeypatch, machine(nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0), require=True))
    assert jb.get_requires_for_build_wheel(None) == ["ninja"]


def test_get_requires_fails_the_install_with_the_reason(monkeypatch):
    _on(monkeypatch, machine(driver=(12, 2)))
    with pytest.raises(SystemExit, match=r"jax_ub: .*CUDA 12\.2.*JAX_UB_ALLOW_NO_CUDA=1"):
        jb.get_requires_for_build_wheel(None)


def test_build_points_cmake_at_the_wheel_nvcc_and_requires_the_extension(monkeypatch, tmp_path):
    nvcc = _fake_nvcc(tmp_path / "nvidia" / "cu13" / "bin" / "nvcc", "13.0")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.delenv("JAX_UB_REQUIRE_CUDA", raising=False)
    _on(monkeypatch, machine(driver=(13, 0)))
    seen = {}

    def build(wheel_directory, config_settings, metadata_directory):
        seen.update(cs=config_settings, cudacxx=os.environ.get("CUDACXX"))
        seen["require"] = os.environ.get("JAX_UB_REQUIRE_CUDA")
        return "jax_ub-0.1.0-cp311-cp311-linux_x86_64.whl"

    _skb(monkeypatch, build_wheel=build)
    assert jb.build_wheel("out", {"cuda": "13.0"}).endswith(".whl")
    assert seen == {"cs": {}, "cudacxx": str(nvcc), "require": "1"}


def test_build_without_the_wheels_in_its_environment_says_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    _on(monkeypatch, machine(driver=(13, 0)))
    with pytest.raises(
        SystemExit, match=r"--no-build-isolation.*pip install \"nvidia-cuda-nvcc>=13.0,<13.1\""
    ):
        jb.build_wheel("out", None)


def test_a_failed_required_build_names_the_opt_out(monkeypatch, capsys):
    monkeypatch.delenv("JAX_UB_REQUIRE_CUDA", raising=False)
    _on(monkeypatch, machine(driver=(13, 0), nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0)))

    def build(*args):
        raise SystemExit(1)

    _skb(monkeypatch, build_wheel=build)
    with pytest.raises(SystemExit):
        jb.build_wheel("out", None)
    assert "set JAX_UB_ALLOW_NO_CUDA=1" in capsys.readouterr().err
    # Where the user required it (CI), the opt-out would not help: not offered.
    monkeypatch.setenv("JAX_UB_REQUIRE_CUDA", "1")
    _on(monkeypatch, machine(nvcc="/usr/local/cuda/bin/nvcc", version=(13, 0), require=True))
    with pytest.raises(SystemExit):
        jb.build_wheel("out", None)
    assert "JAX_UB_ALLOW_NO_CUDA" not in capsys.readouterr().err


def test_pyproject_uses_the_backend():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'build-backend = "jax_ub_backend"' in text and 'backend-path = ["build_backend"]' in text
