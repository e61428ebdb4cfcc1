"""Everything that runs pipelines for real: the engine, the backends stages reach, the app, the CLI.

Subpackages, each importing only those below it (import-linter checks it: pyproject.toml)::

    cli/                     the ``inferline`` command, one module per command group
    ray_ingress.py           the app as a Ray Serve ingress
    server.py                the app with its web console (``create_server``)
    console/ evals/ capacity/  the web console; offline evaluation; workload, load, profile, plan
    http/                    the Litestar app: route groups, problems, auth, metrics, OpenAPI
    runtime/                 the workspace, the one place resources are opened and closed
    backends/                the model pool and engines, indexes, caches, the audit sink
    config/                  the server file, inferline.yaml: its models, loader, environment overrides
    engine/                  the batched inference engine (imports nothing of ours)
"""
