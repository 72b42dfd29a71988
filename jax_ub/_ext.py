"""Loads the compiled extension (``_jax_ub_cuda``), registers its FFI targets, says why not.

Nothing here touches a GPU at import time: the extension is imported and its handlers registered
with XLA (platform ``CUDA``) on first use, by :func:`ensure_registered`.

The extension is a top-level module (installed beside ``jax_ub`` in site-packages) so that running
from a source checkout, where ``./jax_ub`` shadows the installed package, still finds it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib
import logging
import os
import sys
import threading
from typing import Any

import jax

from jax_ub import config

log = logging.getLogger("jax_ub")

_lock = threading.Lock()
_registered = False

# Where jax's nvidia-* wheels put the libraries that the extension dlopen()s, relative to a
# site-packages directory, newest layout first.
_LIBRARY_GLOBS = {
    "cublasLt": [
        "nvidia/cu13/lib/libcublasLt.so.13",
        "nvidia/cublas/lib/libcublasLt.so.13",
        "nvidia/cublas/lib/libcublasLt.so.12",
    ],
    "nccl": ["nvidia/nccl/lib/libnccl.so.2"],
}


@functools.cache
def _build_facts() -> dict[str, Any]:
    try:
        mod = importlib.import_module("_jax_ub_build")
    except ImportError:
        return {
            "cuda_built": False,
            "reason": "jax_ub is not installed (no _jax_ub_build module): run `pip install .` "
            "from the jax_ub checkout",
        }
    return {
        "cuda_built": bool(mod.CUDA_BUILT),
        "reason": mod.REASON,
        "nvcc": mod.NVCC,
        "nvcc_version": mod.NVCC_VERSION,
        "cuda_archs": mod.CUDA_ARCHS,
        "source_hash": getattr(mod, "SOURCE_HASH", None) or None,
    }


# The files of csrc/ the extension's fingerprint covers (cmake/source_hash.cmake: keep in sync).
SOURCE_SUFFIXES = (".cc", ".cu", ".h", ".cuh", ".cpp", ".hpp")


def source_hash(csrc: str) -> str:
    r"""sha256 over ``"<path>\n<sha256 of the file>\n"`` of every C++/CUDA file under ``csrc``
    (paths relative to it, '/'-separated, sorted): what CMake records in the extension."""
    files = []
    for root, _, names in os.walk(csrc):
        files += [
            os.path.relpath(os.path.join(root, n), csrc).replace(os.sep, "/")
            for n in names
            if n.endswith(SOURCE_SUFFIXES)
        ]
    manifest = []
    for rel in sorted(files):
        with open(os.path.join(csrc, rel), "rb") as f:
            manifest.append(f"{rel}\n{hashlib.sha256(f.read()).hexdigest()}\n")
    return hashlib.sha256("".join(manifest).encode()).hexdigest()


def checkout_csrc(package_dir: str | None = None) -> str | None:
    """``csrc/`` of the source checkout jax_ub runs from (editable install, or a checkout on
    ``sys.path``), or None where there is none (an installed wheel)."""
    pkg = package_dir or os.path.dirname(os.path.abspath(__file__))
    csrc = os.path.join(os.path.dirname(pkg), "csrc")
    return csrc if os.path.isfile(os.path.join(csrc, "_jax_ub_build.py.in")) else None


def source_mismatch(mod: Any, csrc: str | None = None) -> str | None:
    """Why the extension ``mod`` was not built from this checkout's ``csrc/``, or None where it
    was, or where there is no checkout to compare with (an installed wheel)."""
    csrc = csrc or checkout_csrc()
    if csrc is None:
        return None
    try:
        built = dict(mod.build_info()).get("source_hash")
    except Exception as e:  # a broken build_info: say so rather than fail the load
        built, why = None, f"its build_info() raised {type(e).__name__}: {e}"
    else:
        why = "it records no source hash: it was built before jax_ub recorded one"
    have = source_hash(csrc)
    if built == have:
        return None
    got = f"built from sources {built[:12]}" if built else why
    root = os.path.dirname(csrc)
    return (
        f"the CUDA extension {getattr(mod, '__file__', '_jax_ub_cuda')} was not built from this "
        f"checkout's {csrc} (expected sources {have[:12]}; {got}): the Python side may call "
        f"kernels, functions or FFI attributes it lacks. Rebuild it: `pip install .` in {root} "
        "(an editable install: `pip install --no-build-isolation -e .`)"
    )


@functools.cache
def _load() -> tuple[Any | None, str]:
    """Returns (extension module or None, reason it is unavailable). Warns (once) when the
    extension was built from other sources than the checkout jax_ub runs from."""
    facts = _build_facts()
    if not facts["cuda_built"]:
        return None, facts["reason"]
    try:
        mod = importlib.import_module("_jax_ub_cuda")
    except ImportError as e:
        return None, f"the CUDA extension was built but cannot be imported: {e}"
    for lib, paths in find_libraries().items():
        mod.set_library_candidates(lib, paths)
    try:
        stale = source_mismatch(mod)
    except OSError as e:  # the checkout's csrc/ cannot be read: nothing to compare with
        log.debug("jax_ub: cannot hash the checkout's csrc/: %s", e)
        stale = None
    if stale:
        log.warning("jax_ub: %s", stale)
    return mod, ""


def find_libraries() -> dict[str, list[str]]:
    """Candidate paths of cuBLASLt and NCCL from the nvidia-* wheels on ``sys.path``."""
    out: dict[str, list[str]] = {}
    for lib, patterns in _LIBRARY_GLOBS.items():
        found: list[str] = []
        for entry in sys.path:
            if not entry or not os.path.isdir(entry):
                continue
            for pattern in patterns:
                for path in glob.glob(os.path.join(entry, pattern)):
                    if path not in found:
                        found.append(path)
        out[lib] = found
    return out


def extension() -> Any | None:
    """The extension module, or None when it is not built/importable."""
    return _load()[0]


def loaded_extension() -> Any:
    """:func:`extension`, typed for calls into it, where the caller already relies on it being
    there (a comm set exists, or :func:`ensure_registered` ran). Not checked: without it, this is
    None, and the call fails as it would on :func:`extension`'s None."""
    return extension()


def cuda_backend() -> str | None:
    """'cuda' when jax has a CUDA backend with devices, else None."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return "cuda" if devices else None


_gpu_backend = cuda_backend


def default_backend() -> str:
    """jax's default backend (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return jax.default_backend()


def cuda_path_available() -> tuple[bool, str]:
    """Whether jax_ub's CUDA kernels can run in this process, and if not, why."""
    if config.get().disable:
        return False, "JAX_UB_DISABLE=1 forces the pure-XLA reference path"
    # No GPU first: on a CPU-only host, advice to rebuild the extension would change nothing.
    if _gpu_backend() is None:
        mod, reason = _load()
        built = "" if mod is not None else f" (and the CUDA extension is not loaded: {reason})"
        return False, (
            f"jax has no CUDA GPU (default backend: {jax.default_backend()!r}); "
            f"the pure-XLA reference path runs{built}"
        )
    mod, reason = _load()
    if mod is None:
        return False, reason
    if too_old := driver_too_old(mod):
        return False, too_old
    lt = mod.cublaslt_description()
    if not lt.startswith("cuBLASLt "):
        return False, lt
    return True, ""


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def driver_too_old(mod) -> str:
    """Why the NVIDIA driver cannot run the extension's CUDA runtime (linked statically: the
    nvcc that built it decides), or "". A CUDA 13 build on a CUDA 12 driver is the usual case: jax
    with its cuda12 plugin runs, every CUDA call of the extension fails. Asked once per process
    (cuda_path_available runs at every traced op; neither the driver nor the build changes)."""
    try:
        rt = dict(mod.runtime_info())
        runtime = int(dict(mod.build_info()).get("cuda_runtime_version") or 0)
    except Exception:  # an extension without these facts: nothing to judge
        return ""
    driver = int(rt.get("driver_version") or 0)
    err = str(rt.get("error") or "")
    if not driver:  # no driver at all (a CPU machine): not this function's case
        return ""
    if "InsufficientDriver" not in err and not (runtime and driver // 1000 < runtime // 1000):
        return ""
    have = f"supports CUDA {_cuda_version(driver)}"
    built = _build_facts().get("nvcc_version") or "?"
    return (
        f"the jax_ub extension was built with CUDA {_cuda_version(runtime) if runtime else '?'} "
        f"(nvcc {built}), but this NVIDIA driver {have}"
        f"{f' ({err})' if err else ''}: rebuild jax_ub with an nvcc no newer than the driver's "
        "CUDA version (e.g. `CUDACXX=/usr/local/cuda-12/bin/nvcc pip install --no-cache-dir "
        "--force-reinstall --no-deps .`), or upgrade the driver"
    )


def enums() -> dict[str, dict[str, int]]:
    """The integers the extension takes from Python, by name, from its C++ enum definitions:
    ``{"ag_algorithm": {"ring": 0, ...}, "rs_algorithm": {...}, "bulk_kind": {...}, "dtype": {...},
    "failure": {...}}``. Raises RuntimeError (saying why) when the extension is not loaded."""
    mod, reason = _load()
    if mod is None:
        raise RuntimeError(f"jax_ub CUDA extension unavailable, so it has no enum table: {reason}")
    return {str(k): {str(n): int(v) for n, v in dict(t).items()} for k, t in dict(mod.enums()).items()}


def ensure_registered() -> None:
    """Registers every FFI target of the extension for platform CUDA (once per process)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        mod = extension()
        if mod is None:
            raise RuntimeError(f"jax_ub CUDA extension unavailable: {_load()[1]}")
        for name, capsule in mod.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        _registered = True


def build_info() -> dict[str, Any]:
    """Which path is active and why: versions, extension build facts, GPU, libraries.

    ``info["cuda_path"]`` is True when jax_ub's CUDA kernels run; ``info["reason"]`` says why not.
    """
    from jax_ub import __version__

    facts = _build_facts()
    mod, load_reason = _load()
    active, reason = cuda_path_available()
    info: dict[str, Any] = {
        "jax_ub": __version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "extension_built": facts["cuda_built"],
        "extension_loaded": mod is not None,
        "cuda_path": active,
        "path": "cuda" if active else "xla-reference",
        "reason": reason or "jax_ub CUDA extension loaded and a CUDA GPU is present",
    }
    if facts.get("nvcc_version"):
        info["nvcc_version"] = facts["nvcc_version"]
        info["cuda_archs"] = facts["cuda_archs"]
    if mod is not None:
        info.update({f"ext_{k}": v for k, v in mod.build_info().items()})
        with contextlib.suppress(OSError):
            stale = source_mismatch(mod)
            if stale:
                info["extension_stale"] = stale
        info.update({f"runtime_{k}": v for k, v in mod.runtime_info().items()})
        info["cublaslt"] = mod.cublaslt_description()
        info["libraries"] = find_libraries()
    elif load_reason:
        info["extension_error"] = load_reason
    return info
