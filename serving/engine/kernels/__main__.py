"""``python -m serving.engine.kernels``: build the CPU kernels now (``make install`` does)."""

import logging
import sys

from serving.engine.kernels import cpu_ops, disabled_reason

logging.basicConfig(level=logging.INFO, format="%(message)s")
if cpu_ops() is None:
    print(f"inferline CPU kernels: unavailable ({disabled_reason()}); the engine uses its torch path")
    sys.exit(0)  # not fatal: the torch path gives the same results
print("inferline CPU kernels: ready")
