"""Inferline's batched inference engine (continuous batching over a paged KV cache).

Layout, one concept per file: ``config`` (options), ``sampling_params``,
``sequence`` (one request's state), ``block_manager`` (KV blocks and the prefix
cache), ``scheduler`` (who runs this step), ``model_runner`` (one batched
forward), ``sampler``, ``models/`` (the forward passes and weight loading),
``engine`` (the step loop and its async front), ``metrics``.

Imports torch and transformers; nothing else of Inferline's.
"""
