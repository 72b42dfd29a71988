"""jax_ub's PEP 517 build backend: scikit-build-core, plus the CUDA compiler from the package index
where the machine needs one.

A PEP 517 backend never sees the extras being installed (``.[cuda13]``), so the CUDA version to
compile for comes from the machine: the NVIDIA driver's CUDA version, or ``-C cuda=13`` /
``JAX_UB_BUILD_CUDA=13`` (``13.0``: no newer than 13.0). Where the install targets CUDA and finds
no usable system nvcc (none, or one newer than the driver), ``get_requires_for_build_wheel`` adds
the compiler wheels (``nvidia-cuda-nvcc`` and the headers and runtime it needs, pinned to that CUDA
version) to the isolated build environment, and ``build_wheel`` points CMake at their nvcc. Where a
system nvcc is usable (CI's, a CUDA toolkit) nothing is downloaded.

On a machine with an NVIDIA driver the extension must build (``JAX_UB_REQUIRE_CUDA=1`` for CMake):
an install without it would run every op on XLA's reference path. ``JAX_UB_ALLOW_NO_CUDA=1``
installs without it instead. With no driver the package installs as before: the extension where a
system nvcc is found, else the reference path alone.

:func:`decide` holds every decision as a pure function of :class:`Machine` (tested in
``tests/cpu/test_build_backend.py``); the rest gathers the facts and delegates to scikit-build-core.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from typing import Any

# The newest CUDA major jax_ub builds for, and the oldest it can run on.
NEWEST_MAJOR = 13
OLDEST_MAJOR = 12
# The package index's compiler, by CUDA major: the wheels, and where nvcc lies in site-packages.
# CUDA 12's nvidia-cuda-nvcc-cu12 ships ptxas and libnvvm only, no nvcc: a CUDA 12 build needs a
# CUDA 12 toolkit on the machine.
COMPILER_WHEELS = {
    13: (
        ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl", "nvidia-cuda-runtime"),
        "nvidia/cu13/bin/nvcc",
    ),
}
CONFIG_KEY = "cuda"  # -C cuda=13
TARGET_VARIABLE = "JAX_UB_BUILD_CUDA"
ALLOW_VARIABLE = "JAX_UB_ALLOW_NO_CUDA"
REQUIRE_VARIABLE = "JAX_UB_REQUIRE_CUDA"
_TRUE = ("1", "true", "yes", "on")


class BuildError(RuntimeError):
    """The install cannot build what this machine needs; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """The facts the decision depends on."""

    driver: tuple[int, int] | None  # CUDA version the NVIDIA driver supports; None: no driver
    nvcc: str | None  # the nvcc CMake would find (CUDACXX, PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda)
    nvcc_version: tuple[int, int] | None  # its release; None where it does not run
    cudacxx: bool  # nvcc came from CUDACXX: the user chose it
    target: str | None  # -C cuda=... or JAX_UB_BUILD_CUDA ("12", "13", "13.0"); None: from the driver
    allow_no_cuda: bool  # JAX_UB_ALLOW_NO_CUDA=1
    require_cuda: bool  # JAX_UB_REQUIRE_CUDA=1


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the build does: extra build requirements, which nvcc, whether the extension must build."""

    requires: tuple[str, ...] = ()  # compiler wheels to add to the build environment
    wheel_nvcc: str | None = None  # path of nvcc under site-packages (COMPILER_WHEELS), if used
    require_cuda: bool = False  # CMake fails where the extension cannot be built
    why: str = ""  # one line: what was decided and why


def _version(text: str) -> tuple[int, int | None]:
    m = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", text)
    if not m:
        raise BuildError(
            f"{CONFIG_KEY}={text!r} (-C {CONFIG_KEY}=... or {TARGET_VARIABLE}): expected a CUDA version "
            f"such as '13' or '13.0'"
        )
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2))


def _fmt(v: tuple[int, int] | None) -> str:
    return "?" if v is None else f"{v[0]}.{v[1]}"


def wheel_requirements(major: int, minor: int | None) -> tuple[str, ...]:
    """The compiler wheels for CUDA ``major``, none newer than ``major.minor`` where given. Each is
    pinned (pip would otherwise pair an older nvcc with the newest headers and libnvvm)."""
    upper = f"{major}.{minor + 1}" if minor is not None else f"{major + 1}"
    return tuple(f"{name}>={major}.0,<{upper}" for name in COMPILER_WHEELS[major][0])


def decide(m: Machine) -> Plan:
    """The build plan for machine ``m``. Raises BuildError where the install cannot do what the
    machine needs and the user did not opt out."""
    opt_out = f"set {ALLOW_VARIABLE}=1 to install without the CUDA extension (XLA's reference path only)"
    driver_text = f"the NVIDIA driver supports CUDA {_fmt(m.driver)}"

    def refuse(reason: str) -> Plan:
        if m.allow_no_cuda:
            return Plan(why=f"{reason}; {ALLOW_VARIABLE}=1: installing without the CUDA extension")
        raise BuildError(f"{reason}. Or {opt_out}")

    if m.target is not None:
        major, minor = _version(m.target)
        source = f"{CONFIG_KEY}={m.target}"
        if not OLDEST_MAJOR <= major <= NEWEST_MAJOR:
            raise BuildError(f"{source}: jax_ub builds for CUDA {OLDEST_MAJOR} to {NEWEST_MAJOR}")
    elif m.driver is None:
        # No driver: as a plain install always did (the extension where a system nvcc exists).
        return Plan(
            require_cuda=m.require_cuda,
            why="no NVIDIA driver: the CUDA extension builds only where a system nvcc is found"
            + (f" ({m.nvcc})" if m.nvcc else ""),
        )
    else:
        if m.driver[0] < OLDEST_MAJOR:
            return refuse(f"{driver_text}; jax_ub needs CUDA >= {OLDEST_MAJOR}: upgrade the driver")
        major = min(m.driver[0], NEWEST_MAJOR)
        minor = m.driver[1] if m.driver[0] == major else None
        source = driver_text

    require = m.require_cuda or not m.allow_no_cuda
    if m.driver is not None and m.driver[0] < major:
        return refuse(
            f"{source} asks for CUDA {major}, but {driver_text}: an extension built with CUDA "
            f"{major} cannot run on it; build for CUDA {m.driver[0]} (-C {CONFIG_KEY}={m.driver[0]}) or "
            "upgrade the driver"
        )
    have = m.nvcc_version[0] if m.nvcc_version else None
    # A toolkit on the machine: of the CUDA asked for, or (from the driver) one the driver runs.
    usable = have is not None and (
        have == major if m.target is not None else OLDEST_MAJOR <= have <= m.driver[0]  # type: ignore[index]
    )
    if m.nvcc and (m.cudacxx or usable):  # or the user's own CUDACXX: no download
        return Plan(
            require_cuda=require, why=f"{source}: building with {m.nvcc} (nvcc {_fmt(m.nvcc_version)})"
        )
    found = f"the system nvcc {m.nvcc} is CUDA {_fmt(m.nvcc_version)}" if m.nvcc else "no system nvcc"
    if major not in COMPILER_WHEELS:
        return refuse(
            f"{source}, so jax_ub builds for CUDA {major}, and {found}; the package index has no "
            f"CUDA {major} nvcc (nvidia-cuda-nvcc-cu12 ships ptxas only): install a CUDA {major} toolkit "
            f"and set CUDACXX=<its bin/nvcc>, or upgrade the driver to CUDA {NEWEST_MAJOR}"
        )
    reqs = wheel_requirements(major, minor)
    return Plan(
        requires=reqs,
        wheel_nvcc=COMPILER_WHEELS[major][1],
        require_cuda=require,
        why=f"{source} and {found}: building with the package index's nvcc ({', '.join(reqs)})",
    )


# ---- the facts ----------------------------------------------------------------------------------


def driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the NVIDIA driver supports (cuDriverGetVersion, no GPU context), or None
    where there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    try:
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
    except AttributeError:
        return None
    return v.value // 1000, v.value % 1000 // 10


def system_nvcc(env: os._Environ[str] | dict[str, str]) -> tuple[str | None, bool]:
    """(the nvcc CMakeLists.txt would use, whether it came from CUDACXX): CUDACXX, else the first
    nvcc on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin or /usr/local/cuda/bin."""
    if env.get("CUDACXX"):
        return env["CUDACXX"], True
    found = shutil.which("nvcc", path=env.get("PATH", ""))
    if found:
        return found, False
    for root in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc"), False
    return None, False


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """The release `nvcc --version` reports, or None where it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _target(config_settings: dict[str, Any] | None, env: os._Environ[str] | dict[str, str]) -> str | None:
    value = (config_settings or {}).get(CONFIG_KEY) or env.get(TARGET_VARIABLE) or None
    if isinstance(value, list):
        value = value[-1]
    return None if value in (None, "", "auto") else str(value)


def machine(config_settings: dict[str, Any] | None = None, env: Any = None) -> Machine:
    env = os.environ if env is None else env
    nvcc, from_cudacxx = system_nvcc(env)
    return Machine(
        driver=driver_cuda_version(),
        nvcc=nvcc,
        nvcc_version=nvcc_version(nvcc) if nvcc else None,
        cudacxx=from_cudacxx,
        target=_target(config_settings, env),
        allow_no_cuda=env.get(ALLOW_VARIABLE, "").strip().lower() in _TRUE,
        require_cuda=env.get(REQUIRE_VARIABLE, "").strip().lower() in _TRUE,
    )


def find_wheel_nvcc(relpath: str, paths: list[str] | None = None) -> str | None:
    """``relpath`` (COMPILER_WHEELS) under the first entry of ``paths`` (sys.path) holding it."""
    for entry in sys.path if paths is None else paths:
        candidate = os.path.join(entry or ".", relpath)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _plan(config_settings: dict[str, Any] | None) -> Plan:
    try:
        return decide(machine(config_settings))
    except BuildError as e:
        raise SystemExit(f"jax_ub: {e}") from None


def _skb_settings(config_settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """The config settings without jax_ub's own key (scikit-build-core refuses unknown ones)."""
    if not config_settings:
        return config_settings
    return {k: v for k, v in config_settings.items() if k != CONFIG_KEY}


def _skbuild() -> Any:
    """scikit-build-core's backend, imported where a hook runs (the decisions above need nothing but
    the standard library, so that they can be tested without it)."""
    from scikit_build_core import build

    return build


def _log(message: str) -> None:
    print(f"jax_ub: {message}", file=sys.stderr, flush=True)


def _build(hook: str, wheel_directory: str, config_settings: Any, metadata_directory: str | None) -> str:
    plan = _plan(config_settings)
    _log(plan.why)
    if plan.wheel_nvcc:
        nvcc = find_wheel_nvcc(plan.wheel_nvcc)
        if nvcc is None:
            raise SystemExit(
                f"jax_ub: {plan.why}, but {plan.wheel_nvcc} is not in this build environment (a "
                "--no-build-isolation build installs no build requirements): pip install "
                + " ".join(f'"{r}"' for r in plan.requires)
                + f" first, or build with isolation. Or set {ALLOW_VARIABLE}=1"
            )
        os.environ["CUDACXX"] = nvcc
    # Required by the user (JAX_UB_REQUIRE_CUDA=1) or by the machine (a driver, -C cuda=...): only
    # the machine's requirement is lifted by the opt-out.
    by_user = os.environ.get(REQUIRE_VARIABLE, "").strip().lower() in _TRUE
    if plan.require_cuda:
        os.environ[REQUIRE_VARIABLE] = "1"
    try:
        return getattr(_skbuild(), hook)(wheel_directory, _skb_settings(config_settings), metadata_directory)
    except SystemExit:
        if plan.require_cuda and not by_user:
            _log(
                f"the CUDA extension is required here ({plan.why}); to install without it "
                f"(XLA's reference path only), set {ALLOW_VARIABLE}=1"
            )
        raise


# ---- PEP 517 hooks ------------------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    plan = _plan(config_settings)
    return [*_skbuild().get_requires_for_build_wheel(_skb_settings(config_settings)), *plan.requires]


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    plan = _plan(config_settings)
    return [*_skbuild().get_requires_for_build_editable(_skb_settings(config_settings)), *plan.requires]


def get_requires_for_build_sdist(config_settings: dict[str, Any] | None = None) -> list[str]:
    return _skbuild().get_requires_for_build_sdist(_skb_settings(config_settings))


def build_wheel(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    return _build("build_wheel", wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str, config_settings: dict[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    return _build("build_editable", wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    return _skbuild().build_sdist(sdist_directory, _skb_settings(config_settings))


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: dict[str, Any] | None = None
) -> str:
    return _skbuild().prepare_metadata_for_build_wheel(metadata_directory, _skb_settings(config_settings))


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: dict[str, Any] | None = None
) -> str:
    return _skbuild().prepare_metadata_for_build_editable(metadata_directory, _skb_settings(config_settings))
