"""The model the engine tests run: the bundled default on the CPU.

``INFERLINE_TEST_MODEL`` and ``INFERLINE_TEST_DEVICE`` point them at another model folder and
device (bench/gpu_check.sh runs them on CUDA that way).
"""

from __future__ import annotations

import os
from pathlib import Path

MODEL = Path(os.environ.get("INFERLINE_TEST_MODEL") or Path(__file__).parents[3] / "models" / "smollm2-135m-instruct")


DEVICE = os.environ.get("INFERLINE_TEST_DEVICE", "cpu")
