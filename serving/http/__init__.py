"""The HTTP layer: the Litestar app (``create_app``), one module per route group (``pipeline_routes``,
``openai_routes``, ``anthropic_routes``, ``audit_routes``, ``ops_routes``...), problem details, auth, HTTP
metrics, the OpenAPI document, and refused requests' audit records.

May import ``serving.runtime`` and below (backends, engine), ``pipeline``, ``stages`` and ``store``.
"""
