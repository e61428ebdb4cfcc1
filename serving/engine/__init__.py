"""Inferline's batched inference engine (continuous batching over a paged KV cache).

Layout, one concept per file: ``config`` (options), ``sampling_params``,
``sequence`` (one request's state), ``block_manager`` (KV blocks and the prefix
cache), ``scheduler`` (who runs this step), ``model_runner`` (one batched
forward), ``sampler``, ``models/`` (the forward passes and weight loading),
``cpu_linear`` (which CPU kernel runs a matmul), ``kernel_calibration`` (what
start-up measures to choose it) and ``calibration`` (where those answers are
kept between processes), ``engine`` (the step loop and its async front),
``metrics``.

Imports torch and transformers; nothing else of Inferline's.
"""

import os

# OpenMP's default spin-waiting turns every small parallel op (an index, an
# attention call) from microseconds into milliseconds when another process
# holds one of the cores, common on the small shared machines we run on
# (docs/engine.md, "OpenMP's wait policy"). It only applies if set before torch
# loads OpenMP, so it lives here, at the top of the engine package.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
