"""Hot reload: the served pipelines follow the ``pipelines:`` folder without a restart.

A changed file is validated as at start (YAML, stages, options, models, ``when:``, and beside the other
pipelines: serving/runtime/pipeline_set.py), built beside the running version and swapped in
(``ServedPipelines.swap``, one step), so a request that already holds the old pipeline finishes on it and the
next one gets the new. The old version is closed once
its last request ends. A new file adds a pipeline; a deleted file retires its pipeline the same way
(new requests then get 404). A file that fails to load changes nothing: the running version keeps
serving, and the error, with file, line and column, is logged, counted in
``inferline_pipeline_reloads_total{result="invalid"}`` and kept in :attr:`PipelineReloader.errors`
(``GET /pipelines``, ``GET /pipelines/{name}``, the console).

``inferline.yaml`` itself (models, indexes, database) is not reloaded: changing it needs a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

from pipeline.errors import SpecError, SpecIssue
from pipeline.loader import LoadedPipeline
from pipeline.runner import Pipeline
from pipeline.spec import PIPELINE_NAME_RULE, is_pipeline_name
from serving.runtime.pipeline_set import PipelineSet, pipeline_files
from serving.runtime.resources import Runtime

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Seen:
    """A file as last looked at: cheap to compare (mtime, size), and the hash of its text."""

    mtime_ns: int
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ReloadError:
    """A file that failed to load; what is served from it (if anything) is the version before."""

    file: str
    #: The pipeline the file served before the failed edit ("" for a new file).
    pipeline: str
    issues: tuple[SpecIssue, ...]
    at: float

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "pipeline": self.pipeline or None,
                "issues": [{"file": i.file, "line": i.line, "col": i.col, "loc": i.loc, "message": i.message}
                           for i in self.issues]}


class PipelineReloader:
    """Keeps *runtime*'s served pipelines in step with the files of the workspace's pipelines folder.

    *on_swap(name, pipeline)* is called after each change (``pipeline`` None: retired), so that the
    layers above (the app's SLO windows) follow.
    """

    def __init__(self, runtime: Runtime, *, registry: CollectorRegistry | None = None,
                 on_swap: Callable[[str, Pipeline | None], None] | None = None):
        self.runtime = runtime
        self.folder = runtime.workspace.pipelines_dir
        self.on_swap = on_swap
        #: Failed loads by file path: cleared when the file loads again or is deleted.
        self.errors: dict[str, ReloadError] = {}
        self._seen: dict[Path, _Seen] = {}
        #: Which pipeline each file serves.
        self._served: dict[Path, str] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self.reloads = Counter("inferline_pipeline_reloads", "Pipeline files reloaded, by result (loaded, "
                               "invalid, retired).", ["result"], registry=registry)
        self.reload_seconds = Histogram("inferline_pipeline_reload_seconds", "Time to validate, load and swap "
                                        "in one changed pipeline file.", registry=registry,
                                        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        for pipeline in runtime.pipelines.values():
            path = Path(pipeline.loaded.file).resolve()
            self._served[path] = pipeline.name
            self._seen[path] = self._look(path, pipeline.loaded.sha256)

    def trigger(self) -> None:
        """Look at the folder now (SIGHUP)."""
        self._wake.set()

    async def watch(self, poll_s: float | None) -> None:
        """Look at the folder every *poll_s* seconds (None: only when triggered), and at once when
        triggered; until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), poll_s)
            self._wake.clear()
            try:
                await self.reload()
            except Exception:  # the watcher must outlive a bug in one pass
                logger.exception("pipelines: reloading %s failed", self.folder)

    async def reload(self) -> list[str]:
        """One pass over the folder; the names of the pipelines added, changed or retired."""
        await self.runtime.deployments.refresh_traffic()
        async with self._lock:
            files = {path.resolve() for path in pipeline_files(self.folder)}
            changed: list[str] = []
            for path in sorted(set(self._served) - files):
                changed.append(self._retire_file(path))
            for path in sorted(files):
                name = await self._reload_file(path)
                if name:
                    changed.append(name)
            for path in set(self.errors):
                if Path(path) not in files:
                    del self.errors[path]
            for path in set(self._seen) - files:
                del self._seen[path]
            return changed

    async def aclose(self) -> None:
        """Wait for the retiring versions to close (their requests end first)."""
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def file_of(self, name: str) -> Path | None:
        """The file that serves pipeline *name*, if one does."""
        return next((path for path, served in self._served.items() if served == name), None)

    async def check(self, name: str, text: str) -> LoadedPipeline:
        """*text* loaded as a version of pipeline *name*, checked as a file edit is, without serving it;
        :class:`SpecError` if it does not load, or if *name* could not name a pipeline (it would name the file)."""
        if not is_pipeline_name(name):
            raise SpecError([SpecIssue(str(self.folder), 1, 1, "name", f"{name[:60]!r} cannot name a pipeline: "
                                       f"use {PIPELINE_NAME_RULE} characters")])
        path = self.file_of(name) or (self.folder / f"{name}.yaml").resolve()
        loaded = await asyncio.to_thread(self.runtime.workspace.load_pipeline_text, text, str(path))
        if loaded.spec.name != name:
            line, col = loaded.name_at
            raise SpecError([SpecIssue(str(path), line, col, "name",
                                       f"this file is pipeline {loaded.spec.name!r}, not {name!r}: "
                                       f"a version of {name!r} says name: {name}")])
        self._check_beside_the_others(loaded, path)
        return loaded

    async def install(self, name: str, text: str, deployed_by: str) -> LoadedPipeline:
        """Make *text* pipeline *name*'s file and serve it now (a deploy, an activation or a rollback
        through the API). It is checked first, as a file edit is; :class:`SpecError` if it does not load,
        and then nothing is written."""
        async with self._lock:
            loaded = await self.check(name, text)
            path = Path(loaded.file)
            await self.runtime.deployments.record_version(loaded, deployed_by)
            staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # not *.yaml: the watcher skips it
            await asyncio.to_thread(staged.write_text, text)
            await asyncio.to_thread(os.replace, staged, path)
        await self.reload()
        await self.runtime.deployments.announce()
        return loaded

    async def remove(self, name: str) -> bool:
        """Delete pipeline *name*'s file and retire it (its requests in flight finish); False if none."""
        async with self._lock:
            path = self.file_of(name)
            if path is None:
                return False
            await asyncio.to_thread(path.unlink, True)
        await self.reload()
        await self.runtime.deployments.announce()
        return True

    def error_for(self, name: str) -> ReloadError | None:
        """The failed edit of the file that serves pipeline *name*, if its last edit failed."""
        return next((error for error in self.errors.values() if error.pipeline == name), None)

    # -- one file ----------------------------------------------------------------------------------

    def _look(self, path: Path, sha256: str | None = None) -> _Seen:
        stat = path.stat()
        if sha256 is None:
            sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        return _Seen(stat.st_mtime_ns, stat.st_size, sha256)

    async def _reload_file(self, path: Path) -> str:
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted between the listing and now: the next pass retires it
            return ""
        seen = self._seen.get(path)
        if seen is not None and (seen.mtime_ns, seen.size) == (stat.st_mtime_ns, stat.st_size):
            return ""
        started = time.perf_counter()
        try:
            now = self._look(path)
        except FileNotFoundError:
            return ""
        self._seen[path] = now
        if seen is not None and seen.sha256 == now.sha256 and str(path) not in self.errors:
            return ""  # touched, not changed
        try:
            loaded = await asyncio.to_thread(self.runtime.workspace.load_pipeline, path)
            self._check_beside_the_others(loaded, path)
        except SpecError as exc:
            self._failed(path, exc)
            return ""
        self.errors.pop(str(path), None)
        name = self._swap(path, loaded)
        took_s = time.perf_counter() - started
        self.reload_seconds.observe(took_s)
        self.reloads.labels("loaded").inc()
        await self.runtime.deployments.record_version(loaded)
        logger.info("pipelines: %s %s from %s in %.1f ms (version %s, sha256 %s)",
                    "loaded" if seen is None else "reloaded", name, path.name, took_s * 1e3,
                    loaded.spec.version or "-", loaded.sha256[:12])
        return name

    def _check_beside_the_others(self, loaded: LoadedPipeline, path: Path) -> None:
        # The set as it would serve: its name is its own, what it calls is served, and the pipelines that call
        # it still find it under its (possibly new) name.
        others = [p.loaded for name, p in self.runtime.pipelines.items() if name != self._served.get(path)]
        PipelineSet.of([*others, loaded]).checked()

    def _failed(self, path: Path, exc: SpecError) -> None:
        served = self._served.get(path, "")
        self.errors[str(path)] = ReloadError(str(path), served, tuple(exc.issues), time.time())
        self.reloads.labels("invalid").inc()
        keeps = f"; {served!r} keeps serving its running version" if served else "; nothing was added"
        logger.error("pipelines: %s did not load%s:\n%s", path, keeps, exc)

    def _swap(self, path: Path, loaded: LoadedPipeline) -> str:
        pipelines = self.runtime.pipelines
        name = loaded.spec.name
        fresh = Pipeline(loaded, self.runtime.resources)
        fresh.start()
        before = self._served.get(path)
        old = pipelines.swap(fresh)  # one step: the next request finds the new version
        self._served[path] = name
        if before is not None and before != name:  # the file's name: changed; its old endpoint goes
            self._retire(before, pipelines.retire(before))
        if old is not None:
            self._close_when_idle(old)
        if self.on_swap is not None:
            self.on_swap(name, fresh)
        return name

    def _retire_file(self, path: Path) -> str:
        name = self._served.pop(path)
        self._retire(name, self.runtime.pipelines.retire(name))
        logger.info("pipelines: %s retired (%s was deleted)", name, path.name)
        return name

    def _retire(self, name: str, pipeline: Pipeline | None) -> None:
        self.reloads.labels("retired").inc()
        if pipeline is not None:
            self._close_when_idle(pipeline)
        if self.on_swap is not None:
            self.on_swap(name, None)

    def _close_when_idle(self, pipeline: Pipeline) -> None:
        async def close() -> None:
            await pipeline.idle()
            await pipeline.aclose()

        task = asyncio.create_task(close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
