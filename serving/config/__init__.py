"""The server file, ``inferline.yaml``: its pydantic models, its loader and environment overrides, its JSON
Schema, and the catalog of names pipelines are checked against.

Its own layer, between ``backends`` and ``engine``: the backends are built from these models (ModelSpec,
IndexSpec, AuditSpec, RaySpec...), so they cannot live in ``runtime``, above the backends; and the pipeline
core only needs the names and prices of the catalog, not the settings. May import ``pipeline`` (the
``Strict`` base model, names, ``Catalog``); nothing else of ours (import-linter checks it).
"""
