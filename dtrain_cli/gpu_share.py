"""Several islands on one GPU host (``dtrain simulate``): each worker process's share of the GPU's memory.

JAX's GPU client takes 75% of every visible GPU's memory at its start (``XLA_PYTHON_CLIENT_MEM_FRACTION``), so a
second worker process on the same GPU would find too little left. :func:`memory_share_env` gives every worker
process an equal share of :data:`GPU_MEMORY_USED`, set in the environment ``dtrain simulate`` starts its workers
with, and only where the workers will run on a GPU (:func:`workers_platform`, decided without starting JAX's GPU
client in the driver, which would take its own 75%) and the user has not set the variable.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GPU_MEMORY_USED = 0.9  # of a GPU's memory, split between the worker processes (the rest: CUDA's, cuDNN's own)
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")  # the packages of JAX's CUDA builds


def _cuda_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def _nvidia_device() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def workers_platform(env: Mapping[str, str], cuda_installed: Callable[[], bool] = _cuda_installed,
                     nvidia_device: Callable[[], bool] = _nvidia_device) -> str:
    """``gpu`` where worker processes started with ``env`` will run on an NVIDIA GPU: ``JAX_PLATFORMS`` unset or
    naming cuda or gpu first, a CUDA build of JAX installed and an NVIDIA device present; else ``other``."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and platforms[0] not in ("cuda", "gpu"):
        return "other"
    return "gpu" if cuda_installed() and nvidia_device() else "other"


def memory_share_env(env: Mapping[str, str], worker_processes: int, platform: str) -> dict[str, str]:
    """``env`` with each of ``worker_processes`` processes' share of the GPU's memory, ``GPU_MEMORY_USED /
    worker_processes`` (three decimals, rounded down), on a GPU with more than one worker process and no
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` set already; otherwise ``env`` as it is."""
    out = dict(env)
    if platform != "gpu" or worker_processes <= 1 or MEM_FRACTION_ENV in env:
        return out
    share = int(GPU_MEMORY_USED / worker_processes * 1000) / 1000
    out[MEM_FRACTION_ENV] = f"{share:.3f}"
    return out
