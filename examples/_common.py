"""The command-line handling the training examples share (train_llama.py, train_tp_block.py).

Importing it lets a source checkout run them without installing jax_ub. Their options with a GPU
and a CPU default (:func:`gpu_cpu_option`, :func:`fill_gpu_cpu_defaults`), the lowest value of
their counts (:func:`check_lowest`) and the simulated CPU devices (:func:`prepare_environment`)
live here; none of it imports jax, so ``--help`` and a bad option answer at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

if importlib.util.find_spec("jax_ub") is None:  # running from a source checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORCE_DEVICES = "--xla_force_host_platform_device_count"
CPU_DEVICES = 4  # simulated CPU devices where neither --cpu-devices nor XLA_FLAGS says
# The counts every training example takes; each must be >= 1.
COUNTS = (
    "steps",
    "batch",
    "seq",
    "hidden",
    "heads",
    "ffn",
    "layers",
    "vocab",
    "motif",
    "dp",
    "tp",
    "log_every",
    "cpu_devices",
)


def gpu_cpu_option(
    p: argparse.ArgumentParser, defaults: dict[str, tuple[Any, Any]], name: str, kind: Any, what: str
) -> None:
    """``--name`` of type ``kind``, unset by default; its help names ``defaults[name]``'s GPU and
    CPU values (:func:`fill_gpu_cpu_defaults` sets them once the backend is known)."""
    gpu, cpu = defaults[name.replace("-", "_")]
    p.add_argument(f"--{name}", type=kind, default=None, help=f"{what} (default: {gpu} on GPU, {cpu} on CPU)")


def fill_gpu_cpu_defaults(
    args: argparse.Namespace, defaults: dict[str, tuple[Any, Any]], on_gpu: bool
) -> None:
    """Each option of ``defaults`` left unset gets its GPU or CPU value."""
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)


def check_lowest(p: argparse.ArgumentParser, args: argparse.Namespace, lowest: dict[str, int]) -> None:
    """An argparse error (exit 2, before jax starts) for an option set below its lowest value:
    ``--cpu-devices 0`` would fail jax's backend, ``--steps 0`` or ``--dp 0`` a division."""
    for name, low in lowest.items():
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}; got {value}")


def prepare_environment(args: argparse.Namespace) -> None:
    """Before jax is imported: simulated CPU devices (ignored by GPU backends). --cpu-devices
    replaces a count in XLA_FLAGS (the flag is the more specific); without it XLA_FLAGS's count
    stands, else CPU_DEVICES."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    has_count = any(f.startswith(FORCE_DEVICES) for f in flags)
    if args.cpu_devices is not None:
        flags = [f for f in flags if not f.startswith(FORCE_DEVICES)]
        flags.append(f"{FORCE_DEVICES}={args.cpu_devices}")
    elif not has_count:
        flags.append(f"{FORCE_DEVICES}={CPU_DEVICES}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
