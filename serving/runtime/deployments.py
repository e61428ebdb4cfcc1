"""Which versions of its pipelines a process serves: versions kept, pins, canary splits and shadows.

The pipelines folder says which version of each pipeline is active (:class:`~serving.runtime.served_pipelines.
ServedPipelines`); :class:`Deployments` keeps every version loaded in the database (its YAML text, by spec
hash), serves a kept one to a request that pins it (``name@version``), splits a pipeline's traffic between
versions (a canary, sticky per caller), mirrors a share of its requests onto a candidate (a shadow), and
tells the other processes on the database when any of that changes. The deploy routes
(serving/http/deploy_routes.py) and ``inferline pipelines`` drive it; the hot reload records what it loads.

    deployments = runtime.deployments      # opened with the runtime
    pipeline = await deployments.pinned("support", "4")
    await deployments.set_traffic("support", {sha_3: 95, sha_4: 5}, updated_by="k1")
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import sqlalchemy as sa

from pipeline.loader import LoadedPipeline
from pipeline.protocols import Resources
from pipeline.runner import Pipeline
from serving.runtime.served_pipelines import ServedPipelines
from serving.runtime.workspace import Workspace
from store.notify import announce
from store.pipeline_versions import PipelineShadows, PipelineTraffic, PipelineVersions, Shadow, version_matches

logger = logging.getLogger(__name__)


class Deployments:
    """Versions, pins, splits and shadows of the pipelines *served* (see the module docstring).

    Until :meth:`open` is given a database it keeps no versions: a pin finds only the version serving, and
    there are no splits or shadows (``inferline run`` and ``eval``).
    """

    def __init__(self, workspace: Workspace, served: ServedPipelines, resources: Resources):
        self.workspace = workspace
        self.served = served
        self.resources = resources
        #: The versions kept in the database (None: this process keeps none).
        self.versions: PipelineVersions | None = None
        #: Canary splits by pipeline name (spec hash -> weight), as the database last said.
        self.traffic: dict[str, dict[str, int]] = {}
        #: Shadows by pipeline name (a candidate version and the share of requests it mirrors).
        self.shadows: dict[str, Shadow] = {}
        self._db: sa.Engine | None = None
        self._traffic_table: PipelineTraffic | None = None
        self._shadow_table: PipelineShadows | None = None
        #: Kept versions a caller pinned, by spec hash: served beside the active ones.
        self._pinned: dict[str, Pipeline] = {}

    async def open(self, db: sa.Engine) -> None:
        """Keep versions in *db*: read its splits and shadows, and record each served pipeline as a version."""
        self._db = db
        self.versions = PipelineVersions(db)
        self._traffic_table = PipelineTraffic(db)
        self._shadow_table = PipelineShadows(db)
        await self.refresh_traffic()
        for pipeline in self.served.values():
            await self.record_version(pipeline.loaded)

    async def aclose(self) -> None:
        """Close the pinned versions this process loaded."""
        for pipeline in self._pinned.values():
            try:
                await pipeline.aclose()
            except Exception:
                logger.exception("pipeline %s: closing a pinned version failed", pipeline.name)

    async def pinned(self, name: str, version: str) -> Pipeline | None:
        """Pipeline *name* at *version* (its ``version:`` label, or a prefix of its spec hash, at least six
        characters): the one serving when it matches, else a kept version, loaded on first use and kept
        beside the serving one. None when there is no such version."""
        serving = self.served.get(name)
        if serving is not None and version_matches(serving.spec.version, serving.loaded.sha256, version):
            return serving
        if self.versions is None:
            return None
        kept = await asyncio.to_thread(self.versions.list, name)
        found = next((v for v in kept if version_matches(v.label, v.spec_sha256, version)), None)
        if found is None:
            return None
        pipeline = self._pinned.get(found.spec_sha256)
        if pipeline is None:
            loaded = await asyncio.to_thread(self.workspace.load_pipeline_text, found.text, found.source)
            pipeline = self._pinned.get(found.spec_sha256)  # another request may have built it meanwhile
            if pipeline is None:
                pipeline = self._pinned[found.spec_sha256] = Pipeline(loaded, self.resources)
                pipeline.start()
        return pipeline

    async def record_version(self, loaded: LoadedPipeline, deployed_by: str = "file") -> None:
        """Keep *loaded* as a version (when versions are kept); a database error is logged, not raised: the
        pipeline serves all the same."""
        if self.versions is None:
            return
        source = Path(loaded.file)
        root = self.workspace.root.resolve()
        if source.is_absolute() and source.is_relative_to(root):
            source = source.relative_to(root)
        try:
            await asyncio.to_thread(self.versions.record, name=loaded.spec.name, label=loaded.spec.version,
                                    sha256=loaded.sha256, text=loaded.text, source=str(source),
                                    deployed_by=deployed_by)
        except Exception as exc:
            logger.error("pipelines: version %s of %s not recorded (%s: %s)", loaded.sha256[:12],
                         loaded.spec.name, type(exc).__name__, exc)

    # -- splits and shadows --------------------------------------------------------------------------------

    async def refresh_traffic(self) -> None:
        """Read the canary splits and shadows again (every reload pass: another process may have changed
        them)."""
        if self._traffic_table is None or self._shadow_table is None:
            return
        try:
            self.traffic = await asyncio.to_thread(self._traffic_table.all)
            self.shadows = await asyncio.to_thread(self._shadow_table.all)
        except Exception as exc:  # the split stays as it was; requests are served all the same
            logger.error("pipelines: traffic splits not read (%s: %s)", type(exc).__name__, exc)

    async def set_traffic(self, name: str, weights: dict[str, int] | None, updated_by: str) -> None:
        """Split *name*'s traffic by *weights* (spec hash -> weight; None: all to the active version)."""
        if self._traffic_table is None:
            raise RuntimeError("this process keeps no versions")
        await asyncio.to_thread(self._traffic_table.set, name, weights, updated_by)
        await self.refresh_traffic()
        await self.announce()

    async def set_shadow(self, name: str, shadow: Shadow | None, updated_by: str) -> None:
        """Mirror a share of *name*'s requests onto a candidate (None: no more)."""
        if self._shadow_table is None:
            raise RuntimeError("this process keeps no versions")
        await asyncio.to_thread(self._shadow_table.set, name, shadow, updated_by)
        await self.refresh_traffic()
        await self.announce()

    def split_choice(self, name: str, sticky: str) -> str | None:
        """The spec hash a request of *name* goes to under its split (None: no split), the same for every
        request of one *sticky* value (the caller's key): a canary's users stay on it."""
        weights = {sha: weight for sha, weight in self.traffic.get(name, {}).items() if weight > 0}
        if not weights:
            return None
        total = sum(weights.values())
        point = int.from_bytes(hashlib.sha256(f"{name}\0{sticky}".encode()).digest()[:8], "big") % total
        for sha, weight in sorted(weights.items()):
            if point < weight:
                return sha
            point -= weight
        return None

    def shadow_choice(self, name: str, request_id: str) -> str | None:
        """The candidate (spec hash) that request *request_id* of *name* also runs on, or None: a share of
        ``percent`` of the requests, picked by the request id (so the same request is always in or out)."""
        shadow = self.shadows.get(name)
        if shadow is None or shadow.percent <= 0:
            return None
        point = int.from_bytes(hashlib.sha256(f"shadow\0{request_id}".encode()).digest()[:8], "big") % 10_000
        return shadow.spec_sha256 if point < shadow.percent * 100 else None

    async def announce(self) -> None:
        """Tell the other processes on this database to look at the folder and the traffic tables now
        (PostgreSQL ``NOTIFY``; store/notify.py). A failure is logged: they still poll."""
        if self._db is None:
            return
        try:
            await asyncio.to_thread(announce, self._db)
        except Exception as exc:
            logger.warning("pipelines: change notice not sent (%s: %s); other processes see the change "
                           "within reload.poll_s", type(exc).__name__, exc)
