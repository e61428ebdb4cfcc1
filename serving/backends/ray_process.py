"""Joining and leaving Ray: a cluster named by ``RAY_ADDRESS``, or a local one."""

from __future__ import annotations

import os

from serving.backends.ray_serve import serve


def start_ray() -> bool:
    """Connect to the Ray cluster of ``RAY_ADDRESS``, or start a local one (no dashboard); True when local."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    ray.init(include_dashboard=False)
    return True


def stop_ray(local: bool) -> None:
    """Leave Ray: a local Ray (``start_ray`` returned True) is shut down with its Serve applications; on a
    cluster the engines stay deployed for the other ingresses (``serve delete inferline`` removes them)."""
    import ray

    if local:
        serve.shutdown()
    ray.shutdown()
