"""Shipping pipeline versions through the API (``admin`` only); ``inferline pipelines`` is its CLI.

    GET    /pipelines/{name}/versions            every version kept, newest first; which one serves
    POST   /pipelines/{name}/versions            {"yaml": "..."}: deploy a new version and serve it
                                                 ({"activate": false}: keep it, serve nothing new)
    POST   /pipelines/{name}/activate            {"spec_sha256": "..."}: serve a version kept before
    POST   /pipelines/{name}/rollback            serve the version kept before the one serving now
    DELETE /pipelines/{name}                     retire the pipeline (its requests in flight finish)
    PUT    /pipelines/{name}/traffic             {"weights": {"3": 95, "4": 5}}: a canary, sticky per key
    DELETE /pipelines/{name}/traffic             all traffic back to the active version
    POST   /pipelines/{name}/promote             the canary becomes the active version, for all traffic
    PUT    /pipelines/{name}/shadow              {"version": "4", "percent": 10}: 10% also run on version 4
    DELETE /pipelines/{name}/shadow              no more shadow runs

The pipelines folder stays the one source of truth: a deploy writes the pipeline's file (checked
first, exactly as an edit is; nothing is written when it does not load) and the hot reload swaps it
in, so a restart serves what was deployed and every server process watching the folder follows.
Every action is an audit record of its own (who, what, which version before and after), chained
like every other: pipeline ``name``, status ``ok``, a policy entry with rule ``deploy``, ``keep``,
``activate``, ``rollback``, ``retire``, ``split``, ``promote`` or ``shadow``.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

from litestar import Request, delete, get, post, put
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from pipeline.context import Principal
from pipeline.errors import SpecError
from pipeline.loader import LoadedPipeline
from pipeline.spec import PIPELINE_NAME_RULE, is_pipeline_name
from serving.http.openapi import problems
from serving.http.problems import Problem
from serving.http.schemas import ActivateRequest, DeployRequest, ShadowRequest, TrafficRequest
from serving.http.served import Executor
from serving.http.services import Services
from serving.runtime.deployments import Deployments
from store.pipeline_versions import PipelineVersion, PipelineVersions, Shadow, version_matches

ADMIN = ("admin",)
_Services = NamedDependency[Services]


async def _admin(request: Request, services: Services, what: str) -> tuple[PipelineVersions, Principal | None]:
    """The kept versions and the admin's principal, once the path's pipeline name is one a pipeline may
    have: a name that is not (a NUL, ``..``, a path, 5,000 characters) never reaches a file."""
    principal = await services.auth.authorize(request, ADMIN, what)
    name = str(request.path_params.get("name", ""))
    if not is_pipeline_name(name):
        raise Problem(400, "Bad request", f"{name[:60]!r} cannot name a pipeline: use {PIPELINE_NAME_RULE} "
                      "characters", "invalid_pipeline_name", extra={"param": "name"})
    versions = services.deployments.versions
    if versions is None:
        raise Problem(503, "Backend unavailable", "pipeline versions are not kept by this server", "backend_error")
    return versions, principal


def _by(principal: Principal | None) -> str:
    """Who made a change, as versions, splits and shadows record it."""
    return principal.key_id if principal is not None else "anonymous"


def _version_json(version: PipelineVersion, serving: str | None) -> dict[str, Any]:
    return {"pipeline": version.name, "version": version.label, "spec_sha256": version.spec_sha256,
            "source": version.source, "deployed_by": version.deployed_by,
            "deployed_at": version.deployed_at.isoformat(), "active": version.spec_sha256 == serving}


def _named(kept: list[PipelineVersion], version: str) -> list[PipelineVersion]:
    """The kept versions *version* names: by their ``version:`` label, or six or more characters of their hash."""
    return [v for v in kept if version_matches(v.label, v.spec_sha256, version)]


def _serving(executor: Executor, name: str) -> str | None:
    pipeline = executor.pipelines.get(name)
    return pipeline.loaded.sha256 if pipeline is not None else None


@get("/pipelines/{name:str}/versions", summary="List a pipeline's versions (admin)", tags=["deploy"],
     responses=problems(400, 401, 403, 404, 503))
async def list_versions(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    versions, _ = await _admin(request, services, "list pipeline versions")
    found = await asyncio.to_thread(versions.list, name)
    if not found and name not in services.executor.pipelines:
        raise Problem(404, "Not found", f"no pipeline {name!r} and no version of one", "pipeline_not_found")
    serving = _serving(services.executor, name)
    return {"pipeline": name, "serving": serving, "versions": [_version_json(v, serving) for v in found],
            "traffic": services.deployments.traffic.get(name), "shadow": _shadow_json(services.deployments, name)}


def _shadow_json(deployments: Deployments, name: str) -> dict[str, Any] | None:
    shadow = deployments.shadows.get(name)
    return None if shadow is None else {"spec_sha256": shadow.spec_sha256, "percent": shadow.percent}


@post("/pipelines/{name:str}/versions", summary="Deploy a new version of a pipeline and serve it (admin)",
      tags=["deploy"], status_code=201, responses=problems(400, 401, 403, 413, 422, 503))
async def deploy(name: FromPath[str], data: JSONBody[DeployRequest], request: Request,
                 services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "deploy pipelines")
    if not data.activate:
        return await _keep(services, versions, principal, name, data.yaml)
    return await _install(services, versions, principal, name, data.yaml, "deploy")


@post("/pipelines/{name:str}/activate", summary="Serve a version kept before (admin)", tags=["deploy"],
      status_code=200, responses=problems(400, 401, 403, 404, 422, 503))
async def activate(name: FromPath[str], data: JSONBody[ActivateRequest], request: Request,
                   services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "activate pipeline versions")
    wanted = data.spec_sha256
    kept = await asyncio.to_thread(versions.list, name)
    matches = [v for v in kept if len(wanted) >= 6 and v.spec_sha256.startswith(wanted)] or \
        [v for v in kept if v.label == wanted][:1]  # a label names its newest version
    if len(matches) != 1:
        raise Problem(404 if not matches else 400, "Not found" if not matches else "Bad request",
                      _not_one(name, wanted, len(matches)), "version_not_found")
    return await _install(services, versions, principal, name, matches[0].text, "activate")


def _not_one(name: str, wanted: str, found: int) -> str:
    """Why *wanted* does not name one kept version of *name* (*found* of them match it)."""
    if found:
        return f"{found} versions of {name!r} have a spec hash starting {wanted!r}: give more of it"
    if len(wanted) < 6:
        return (f"no version of {name!r} is labelled {wanted!r}, and a spec hash prefix needs six or more characters "
                f"({wanted!r} has {len(wanted)}): `inferline pipelines versions {name}` lists them")
    return f"no version of {name!r} with spec_sha256 {wanted!r} or labelled so"


@post("/pipelines/{name:str}/rollback", summary="Serve the version kept before the one serving now (admin)",
      tags=["deploy"], status_code=200, responses=problems(400, 401, 403, 404, 409, 503))
async def rollback(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "roll back pipelines")
    kept = await asyncio.to_thread(versions.list, name)
    serving = _serving(services.executor, name)
    position = next((i for i, v in enumerate(kept) if v.spec_sha256 == serving), None)
    if position is None:
        raise Problem(404, "Not found", f"pipeline {name!r} is not served from a kept version", "pipeline_not_found")
    if position + 1 >= len(kept):
        raise Problem(409, "Conflict", f"pipeline {name!r} serves its oldest kept version: nothing to roll back to",
                      "nothing_to_roll_back")
    return await _install(services, versions, principal, name, kept[position + 1].text, "rollback")


@delete("/pipelines/{name:str}", summary="Retire a pipeline (admin); its versions stay kept", tags=["deploy"],
        status_code=200, responses=problems(400, 401, 403, 404, 503))
async def retire(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    _, principal = await _admin(request, services, "retire pipelines")
    before = services.executor.pipelines.get(name)
    if before is None or not await services.reloader.remove(name):
        raise Problem(404, "Not found", f"no pipeline {name!r} is served from the pipelines folder",
                      "pipeline_not_found")
    await _audit(services, principal, "retire", name, before.spec.version, before.loaded.sha256, "", "")
    return {"pipeline": name, "retired": True, "spec_sha256": before.loaded.sha256}


@put("/pipelines/{name:str}/traffic", summary="Split a pipeline's traffic between versions (admin)",
     tags=["deploy"], status_code=200, responses=problems(400, 401, 403, 404, 422, 503))
async def set_traffic(name: FromPath[str], data: JSONBody[TrafficRequest], request: Request,
                      services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "split pipeline traffic")
    kept = await asyncio.to_thread(versions.list, name)
    weights: dict[str, int] = {}
    for version, weight in data.weights.items():
        matches = _named(kept, version)
        if len({v.spec_sha256 for v in matches}) != 1 or weight < 0:
            raise Problem(400, "Bad request", f"weights: {version!r} must name one kept version of {name!r} (its "
                          "version: label or 6+ characters of its spec hash) with a weight of 0 or more",
                          "invalid_traffic", extra={"versions": [v.label for v in kept]})
        weights[matches[0].spec_sha256] = weights.get(matches[0].spec_sha256, 0) + weight
    if sum(weights.values()) <= 0:
        raise Problem(400, "Bad request", "weights: at least one weight must be above 0", "invalid_traffic")
    await services.deployments.set_traffic(name, weights, _by(principal))
    split = ", ".join(f"{sha[:12]}: {weight}" for sha, weight in sorted(weights.items()))
    active = services.executor.pipelines.get(name)
    await _audit(services, principal, "split", name, active.spec.version if active else "",
                 active.loaded.sha256 if active else "", "", "", detail=f"split {name}: {split}")
    return {"pipeline": name, "weights": weights}


@delete("/pipelines/{name:str}/traffic", summary="All of a pipeline's traffic to its active version (admin)",
        tags=["deploy"], status_code=200, responses=problems(400, 401, 403, 503))
async def clear_traffic(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    _, principal = await _admin(request, services, "split pipeline traffic")
    await services.deployments.set_traffic(name, None, _by(principal))
    await _audit(services, principal, "split", name, "", "", "", "", detail=f"split {name}: cleared")
    return {"pipeline": name, "weights": None}


@post("/pipelines/{name:str}/promote", summary="Make the canary the active version, for all traffic (admin)",
      tags=["deploy"], status_code=200, responses=problems(400, 401, 403, 404, 409, 503))
async def promote(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "promote pipeline versions")
    serving = _serving(services.executor, name)
    split = services.deployments.traffic.get(name, {})
    canaries = [sha for sha, weight in split.items() if weight > 0 and sha != serving]
    if len(canaries) != 1:
        raise Problem(409, "Conflict", f"pipeline {name!r} has {len(canaries)} canary versions in its split; promote "
                      "needs exactly one (activate the one you mean instead)", "no_single_canary")
    canary = await asyncio.to_thread(versions.by_sha256, canaries[0], name)
    if canary is None:
        raise Problem(404, "Not found", f"the canary {canaries[0][:12]} of {name!r} is not kept", "version_not_found")
    answer = await _install(services, versions, principal, name, canary.text, "promote")
    await services.deployments.set_traffic(name, None, _by(principal))
    return answer


@put("/pipelines/{name:str}/shadow", summary="Mirror a share of a pipeline's requests onto a candidate (admin)",
     tags=["deploy"], status_code=200, responses=problems(400, 401, 403, 404, 422, 503))
async def set_shadow(name: FromPath[str], data: JSONBody[ShadowRequest], request: Request,
                     services: _Services) -> dict[str, Any]:
    versions, principal = await _admin(request, services, "shadow pipeline traffic")
    kept = await asyncio.to_thread(versions.list, name)
    wanted = data.version
    matches = {v.spec_sha256: v for v in _named(kept, wanted)}
    if len(matches) != 1:
        raise Problem(404 if not matches else 400, "Not found" if not matches else "Bad request",
                      f"version: {wanted!r} must name one kept version of {name!r} (its version: label or 6+ "
                      f"characters of its spec hash); {len(matches)} do", "version_not_found",
                      extra={"versions": [v.label for v in kept]})
    candidate = next(iter(matches.values()))
    await services.deployments.set_shadow(name, Shadow(candidate.spec_sha256, data.percent), _by(principal))
    await _audit(services, principal, "shadow", name, candidate.label, candidate.spec_sha256, "", "",
                 detail=f"shadow {name}: {data.percent:g}% also run on version {candidate.label} "
                        f"({candidate.spec_sha256[:12]})")
    return {"pipeline": name, "shadow": {"spec_sha256": candidate.spec_sha256, "version": candidate.label,
                                         "percent": data.percent}}


@delete("/pipelines/{name:str}/shadow", summary="Stop mirroring a pipeline's requests (admin)", tags=["deploy"],
        status_code=200, responses=problems(400, 401, 403, 503))
async def clear_shadow(name: FromPath[str], request: Request, services: _Services) -> dict[str, Any]:
    _, principal = await _admin(request, services, "shadow pipeline traffic")
    await services.deployments.set_shadow(name, None, _by(principal))
    await _audit(services, principal, "shadow", name, "", "", "", "", detail=f"shadow {name}: cleared")
    return {"pipeline": name, "shadow": None}


async def _keep(services: Services, versions: PipelineVersions, principal: Principal | None, name: str,
                text: str) -> dict[str, Any]:
    """Check *text* as a version of *name* and keep it, serving nothing new."""
    try:
        loaded = await services.reloader.check(name, text)
    except SpecError as exc:
        raise _invalid(exc) from exc
    await services.deployments.record_version(loaded, _by(principal))
    version = await asyncio.to_thread(versions.by_sha256, loaded.sha256, name)
    if version is None:
        raise Problem(503, "Backend unavailable", "the version could not be kept (see the server log)",
                      "backend_error")
    await _audit(services, principal, "keep", name, loaded.spec.version, loaded.sha256, "", "",
                 detail=f"keep {name}: version {loaded.spec.version} ({loaded.sha256[:12]}), not served")
    return {**_version_json(version, _serving(services.executor, name)), **await _label_warnings(versions, loaded)}


async def _label_warnings(versions: PipelineVersions, loaded: LoadedPipeline) -> dict[str, list[str]]:
    """``{"warnings": [...]}`` when *loaded*'s ``version:`` label also names other kept versions (a pin, split
    or shadow by that label is then ambiguous); nothing otherwise."""
    name, label = loaded.spec.name, loaded.spec.version
    others = [v.spec_sha256[:12] for v in await asyncio.to_thread(versions.labelled, name, label)
              if v.spec_sha256 != loaded.sha256]
    if not others:
        return {}
    unset = "" if "version" in loaded.spec.model_fields_set else \
        " (the file has no version:, so its label is the default)"
    return {"warnings": [
        f"version label {label!r}{unset} also names {len(others)} other kept version(s) of {name!r} "
        f"({', '.join(others)}): a pin by that label now takes the newest, and a split or shadow by it is refused; "
        "set a version: of its own in the file, or name versions by spec hash"]}


def _invalid(exc: SpecError) -> Problem:
    return Problem(400, "Invalid pipeline", str(exc), "invalid_pipeline",
                   extra={"issues": [{"line": i.line, "col": i.col, "loc": i.loc, "message": i.message}
                                     for i in exc.issues]})


async def _install(services: Services, versions: PipelineVersions, principal: Principal | None, name: str,
                   text: str, action: str) -> dict[str, Any]:
    before = services.executor.pipelines.get(name)
    try:
        loaded = await services.reloader.install(name, text, _by(principal))
    except SpecError as exc:
        raise _invalid(exc) from exc
    except OSError as exc:
        raise Problem(503, "Backend unavailable", f"the pipelines folder cannot be written: {exc}",
                      "backend_error") from exc
    serving = _serving(services.executor, name)
    if serving != loaded.sha256:
        raise Problem(409, "Conflict", f"pipeline {name!r} did not switch to {loaded.sha256[:12]} (the folder "
                      "changed meanwhile?)", "deploy_conflict")
    await _audit(services, principal, action, name, loaded.spec.version, loaded.sha256,
                 before.spec.version if before else "", before.loaded.sha256 if before else "")
    version = await asyncio.to_thread(versions.by_sha256, loaded.sha256, name)
    assert version is not None  # recorded by install
    warnings = await _label_warnings(versions, loaded) if action == "deploy" else {}
    return {**_version_json(version, serving), "previous_spec_sha256": before.loaded.sha256 if before else None,
            **warnings}


async def _audit(services: Services, principal: Principal | None, action: str, name: str, version: str,
                 sha256: str, before_version: str, before_sha256: str, *, detail: str = "") -> None:
    """The action as an audit record of its own, chained like a request's."""
    now = datetime.now(UTC)
    was = f"version {before_version} ({before_sha256[:12]})" if before_sha256 else "nothing"
    now_serving = f"version {version} ({sha256[:12]})" if action != "retire" else "retired"
    change = detail or f"{action} {name}: {was} -> {now_serving}"
    await services.audit_sink.write({
        "request_id": uuid.uuid4().hex, "trace_id": None, "received_at": now, "completed_at": now,
        "duration_ms": 0.0, "key_id": principal.key_id if principal else None,
        "role": principal.role if principal else None, "client_addr": None, "pipeline": name[:200],
        "pipeline_version": version, "spec_sha256": sha256, "model": None,
        "policy": [{"stage": "server", "where": "deploy", "rule": action, "category": "deployment",
                    "action": "allow", "score": 1.0, "span": [], "message": change,
                    "route": f"/pipelines/{name}"}],
        "policy_action": "allow", "policy_categories": "deployment", "status": "ok", "http_status": 200,
        "error_type": None, "content_mode": "hash", "input_content": "", "output_content": "",
    })


ROUTES = [list_versions, deploy, activate, rollback, retire, set_traffic, clear_traffic, promote, set_shadow,
          clear_shadow]
