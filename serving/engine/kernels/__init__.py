"""Our C++ CPU kernels, compiled once on the machine that runs them.

``cpu_ops()`` returns ``torch.ops.inferline`` once the extension is built and
loaded, or None when it cannot be (no C++ compiler, ``INFERLINE_KERNELS=0``, a
build error); callers then take the pure-torch path, which gives the same
results more slowly. The first call compiles (about half a minute) into
``$INFERLINE_KERNEL_CACHE`` (default ``~/.cache/inferline/kernels``), under a
name that hashes the source, the torch version and this CPU's instruction set
flags, so a build is never reused on a machine it was not made for.
``make install`` builds it ahead of time: ``python -m serving.engine.kernels``.

Kernels: ``paged_attention`` (paged_attention.cpp); ``rms_norm``, ``add_rms_norm_``, ``rope_`` and
``silu_mul`` (layer_ops.cpp), the small steps of a layer fused; ``small_linear`` and ``small_linear_int8``
(small_linear.cpp), the linear layers of decode-sized batches, float32 or int8 weights; ``block_linear`` and
``block_dequantize`` (block_linear.cpp), GGUF's Q8_0, Q4_0 and Q4_1 blocks as they are. The matmuls and
attention run on a thread pool of our own (pool.h, pool.cpp) whose helpers spin briefly between calls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(_HERE / name for name in ("paged_attention.cpp", "layer_ops.cpp", "small_linear.cpp",
                                           "block_linear.cpp", "pool.cpp"))
HEADERS = (_HERE / "vec.h", _HERE / "pool.h")
_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_ops():
    """``torch.ops.inferline`` with the CPU kernels registered, or None (see the module docstring)."""
    if "ops" in _state:  # loaded (or refused) once: no lock on the hot path (int8_linear asks every matmul)
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load()
        return _state["ops"]


def disabled_reason() -> str | None:
    """Why ``cpu_ops()`` returned None, once it has been called."""
    return _state.get("reason")  # type: ignore[return-value]


def _load():
    if os.environ.get("INFERLINE_KERNELS", "1") == "0":
        _state["reason"] = "INFERLINE_KERNELS=0"
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"inferline_kernels_{build_key()}"
        build_dir = Path(os.environ.get("INFERLINE_KERNEL_CACHE", Path.home() / ".cache/inferline/kernels")) / name
        build_dir.mkdir(parents=True, exist_ok=True)
        # -fopenmp: at::parallel_for is inline OpenMP; without it every kernel runs on one thread. The
        # libgomp.so.1 it needs is the one torch bundles and has already loaded (same soname).
        load(name, [str(s) for s in SOURCES], build_directory=str(build_dir), is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"],
             verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: fall back, loudly once
        _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("engine: the C++ CPU kernels are unavailable (%s); using the slower torch path",
                       _state["reason"])
        return None
    return torch.ops.inferline


@functools.cache
def build_key() -> str:
    """What the kernels' build depends on, hashed: their sources, torch's version, the machine and its
    instruction set (the build folder's name; start-up measurements are kept under it too)."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(b"-fopenmp")
    digest.update(platform.machine().encode())
    digest.update(cpu_flags().encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's instruction-set flags line of ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``)."""
    return _cpuinfo_line(("flags", "Features")) or platform.processor()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    line = _cpuinfo_line(("model name",))
    return line.partition(":")[2].strip() if line else platform.processor() or platform.machine()


@functools.cache
def _cpuinfo_line(prefixes: tuple[str, ...]) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(prefixes):
                return line
    except OSError:
        pass
    return None

