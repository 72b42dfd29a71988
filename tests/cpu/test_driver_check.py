"""The extension links the CUDA runtime of the nvcc that built it: on an older driver every CUDA
call fails. jax_ub._ext.driver_too_old says so, with what to do, where the CUDA path would
otherwise read as available (jax's own cuda12 plugin runs on that driver)."""

from __future__ import annotations

from jax_ub import _ext


class FakeExtension:
    def __init__(self, driver: int, runtime: int, error: str = ""):
        self._rt = {"driver_version": driver, "device_count": 0 if error else 1}
        if error:
            self._rt["error"] = error
        self._runtime = runtime

    def runtime_info(self):
        return dict(self._rt)

    def build_info(self):
        return {"cuda_runtime_version": self._runtime}


def test_a_cuda13_build_on_a_cuda12_driver_is_named():
    mod = FakeExtension(
        12040,
        13000,
        "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
    )
    why = _ext.driver_too_old(mod)
    assert "built with CUDA 13.0" in why and "driver supports CUDA 12.4" in why, why
    assert "CUDACXX=" in why and "upgrade the driver" in why, why


def test_an_older_major_driver_is_named_even_without_the_runtime_error():
    assert "driver supports CUDA 12.8" in _ext.driver_too_old(FakeExtension(12080, 13000))


def test_matching_or_newer_drivers_pass():
    assert _ext.driver_too_old(FakeExtension(13000, 13000)) == ""
    assert _ext.driver_too_old(FakeExtension(13010, 12080)) == ""
    assert _ext.driver_too_old(FakeExtension(12020, 12080)) == ""  # minor-version compatibility


def test_an_extension_without_these_facts_is_not_judged():
    assert _ext.driver_too_old(object()) == ""


def test_no_driver_at_all_is_not_called_too_old():
    """Without libcuda the runtime also says InsufficientDriver, with driver version 0: that is a
    machine without a GPU driver (the doctor's own message), not an old driver."""
    assert (
        _ext.driver_too_old(
            FakeExtension(0, 13000, "cudaErrorInsufficientDriver: CUDA driver version is insufficient")
        )
        == ""
    )
