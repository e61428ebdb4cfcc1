"""The Ray Serve application of a server, as options: what ``inferline deploy`` writes for ``serve deploy``.

One application, ``inferline``: an ``ingress`` deployment (the HTTP app, ``ray_ingress:``) and one
``engine-<model>`` deployment per model of ``backend: ray``, with that model's ``ray:`` section as its
replicas, autoscaling and resources, and its ``placement`` as the request router (``prefix``: ours,
:mod:`serving.backends.ray_router`; ``least_loaded``: Ray Serve's own)::

    models:
      smol:
        backend: ray
        source: models/smollm2-135m-instruct
        ray:
          autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}
          ray_actor_options: {num_cpus: 2, num_gpus: 0}
    ray_ingress: {num_replicas: 2, ray_actor_options: {num_cpus: 1}}

This module imports no Ray: writing the file works where Ray is not installed. The deployments
themselves are in :mod:`serving.backends.ray_replica`; the file's ``import_path`` names
:func:`serving.ray_ingress.build_app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import InferlineError
from serving.config.models import ModelSpec, RaySpec
from serving.config.server import ServerSpec

#: The Ray Serve application name; the ingress finds the engines by it.
APP_NAME = "inferline"
INGRESS_NAME = "ingress"
IMPORT_PATH = "serving.ray_ingress:build_app"
#: The request router of ``placement: prefix`` models, by import path (a serve config file names it so).
PREFIX_ROUTER = "serving.backends.ray_router.PrefixRouter"
#: Leading full KV blocks of a prompt that make its prefix key (as serving.backends.placement.Placement's default).
PREFIX_BLOCKS = 4


def deployment_name(model: str) -> str:
    """The Ray Serve deployment that runs *model*'s engine."""
    return f"engine-{model}"


def ray_models(server: ServerSpec) -> dict[str, ModelSpec]:
    """The models of ``backend: ray``, in file order."""
    return {name: spec for name, spec in server.models.items() if spec.backend == "ray"}


def deployment_options(spec: ModelSpec) -> dict[str, Any]:
    """Ray Serve deployment options of a ray model: ``num_replicas`` or ``autoscaling_config``, resources,
    and with ``placement: prefix`` our request router with the model's KV block size."""
    options = scaling_options(spec.ray or RaySpec())
    if spec.placement == "prefix":
        options["request_router_config"] = {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"block_size": spec.kv_cache.block_size, "prefix_blocks": PREFIX_BLOCKS,
                                      "max_imbalance": spec.max_imbalance},
        }
    return options


def scaling_options(ray: RaySpec) -> dict[str, Any]:
    """Replicas or autoscaling, ``max_ongoing_requests`` and resources of a deployment (engine or ingress)."""
    options: dict[str, Any] = {}
    if ray.autoscaling is not None:
        scaling = ray.autoscaling
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s, "downscale_delay_s": scaling.downscale_delay_s,
            "look_back_period_s": scaling.look_back_period_s,
        }
        if scaling.metrics_interval_s is not None:
            options["autoscaling_config"]["metrics_interval_s"] = scaling.metrics_interval_s
    else:
        options["num_replicas"] = ray.num_replicas or 1
    options["max_ongoing_requests"] = ray.max_ongoing_requests
    options["ray_actor_options"] = {"num_cpus": ray.ray_actor_options.num_cpus,
                                    "num_gpus": ray.ray_actor_options.num_gpus}
    return options


def ingress_options(server: ServerSpec) -> dict[str, Any]:
    """Deployment options of the ``ingress`` (the HTTP app): ``ray_ingress:``, else one replica of 1 CPU."""
    return scaling_options(server.ray_ingress or RaySpec())


def serve_config(server: ServerSpec, config_path: Path) -> dict[str, Any]:
    """The ``serve deploy`` config of *server* loaded from *config_path* (written into ``args`` as an
    absolute path: each Ray node must see the same file and model folders there)."""
    models = ray_models(server)
    if not models:
        raise InferlineError(f"{config_path}: no model has backend: ray, so there is nothing for Ray Serve to run "
                             f"(models: {', '.join(server.models) or 'none'}); set backend: ray and a ray: "
                             f"section on the models to deploy")
    deployments = [{"name": INGRESS_NAME, **ingress_options(server)}]
    deployments += [{"name": deployment_name(name), **deployment_options(spec)} for name, spec in models.items()]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": server.http.host, "port": server.http.port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
            "args": {"config": str(config_path.resolve())}, "deployments": deployments,
        }],
    }
