"""Ray Serve, imported once for the Ray modules (needs the ``ray`` extra: ``pip install 'inferline[ray]'``)."""

import warnings

with warnings.catch_warnings():
    # Ray Serve's own pydantic models use V1-style Field options; not ours to fix, and warnings are errors in tests.
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray import serve

__all__ = ["serve"]
