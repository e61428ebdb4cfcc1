"""The Ray Serve application of a server, as options: what ``inferline deploy`` writes for ``serve deploy``.

One application, ``inferline``: an ``ingress`` deployment (the HTTP app) and one ``engine-<model>``
deployment per model of ``backend: ray``, with that model's ``ray:`` section as its replicas,
autoscaling and resources::

    models:
      smol:
        backend: ray
        source: models/smollm2-135m-instruct
        ray:
          autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}
          ray_actor_options: {num_cpus: 2, num_gpus: 0}

This module imports no Ray: writing the file works where Ray is not installed. The deployments
themselves are in :mod:`serving.ray_backend`, whose ``build_app`` the file's ``import_path`` names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import InferlineError
from pipeline.spec import ModelSpec, RaySpec, ServerSpec

#: The Ray Serve application name; the ingress finds the engines by it.
APP_NAME = "inferline"
INGRESS_NAME = "ingress"
IMPORT_PATH = "serving.ray_backend:build_app"


def deployment_name(model: str) -> str:
    """The Ray Serve deployment that runs *model*'s engine."""
    return f"engine-{model}"


def ray_models(server: ServerSpec) -> dict[str, ModelSpec]:
    """The models of ``backend: ray``, in file order."""
    return {name: spec for name, spec in server.models.items() if spec.backend == "ray"}


def deployment_options(spec: ModelSpec) -> dict[str, Any]:
    """Ray Serve deployment options (``num_replicas`` or ``autoscaling_config``, resources) of a ray model."""
    ray = spec.ray or RaySpec()
    options: dict[str, Any] = {}
    if ray.autoscaling is not None:
        scaling = ray.autoscaling
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas, "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s, "downscale_delay_s": scaling.downscale_delay_s,
        }
    else:
        options["num_replicas"] = ray.num_replicas or 1
    options["max_ongoing_requests"] = ray.max_ongoing_requests
    options["ray_actor_options"] = {"num_cpus": ray.ray_actor_options.num_cpus,
                                    "num_gpus": ray.ray_actor_options.num_gpus}
    return options


def serve_config(server: ServerSpec, config_path: Path) -> dict[str, Any]:
    """The ``serve deploy`` config of *server* loaded from *config_path* (written into ``args`` as an
    absolute path: each Ray node must see the same file and model folders there)."""
    models = ray_models(server)
    if not models:
        raise InferlineError(f"{config_path}: no model has backend: ray, so there is nothing for Ray Serve to run "
                             f"(models: {', '.join(server.models) or 'none'}); set backend: ray and a ray: "
                             f"section on the models to deploy")
    deployments = [{"name": INGRESS_NAME, "num_replicas": 1, "ray_actor_options": {"num_cpus": 1, "num_gpus": 0}}]
    deployments += [{"name": deployment_name(name), **deployment_options(spec)} for name, spec in models.items()]
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": server.http.host, "port": server.http.port},
        "applications": [{
            "name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH,
            "args": {"config": str(config_path.resolve())}, "deployments": deployments,
        }],
    }
