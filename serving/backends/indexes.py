"""The server's vector indexes: loaded at start, swapped for rebuilt versions while serving.

``IndexRegistry`` is the live ``Mapping[str, VectorIndex]`` the ``retrieve``
stage reads. A watcher looks at each index's ``CURRENT`` pointer every
``reload_every_s``; a new version is loaded beside the old one and then swapped
in with one assignment, so a request that already holds the old index finishes
on it and the next one gets the new.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import fields
from pathlib import Path

from serving.config.server import IndexSpec, ServerSpec
from store.embeddings import shared_embedder
from store.vector_index import IndexSettings, VectorStore

logger = logging.getLogger(__name__)


def index_folder(server: ServerSpec, root: Path, name: str) -> Path:
    """Where index *name* of *server*'s config lives (relative paths from *root*, the config's folder)."""
    spec = server.indexes.get(name)
    return root / (spec.path if spec and spec.path else f"indexes/{name}")


def index_settings(spec: IndexSpec | None, **overrides: object) -> IndexSettings:
    spec = spec or IndexSpec()
    values = spec.model_dump(include={f.name for f in fields(IndexSettings)})
    values.update({k: v for k, v in overrides.items() if v is not None})
    return IndexSettings(**values)


class IndexRegistry(Mapping[str, VectorStore]):
    def __init__(self, server: ServerSpec, root: Path):
        self.server = server
        self.root = root
        self._loaded: dict[str, VectorStore] = {}
        #: Indexes already reported as not built: the watcher asks every ``reload_every_s``, the log says it once.
        self._reported_missing: set[str] = set()

    def __getitem__(self, name: str) -> VectorStore:
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded)

    def __len__(self) -> int:
        return len(self._loaded)

    def refresh(self, names: Collection[str] | None = None) -> list[str]:
        """Load every declared index (or those of *names*) whose current version is not the one loaded;
        the names swapped."""
        swapped = []
        for name, spec in self.server.indexes.items():
            if names is not None and name not in names:
                continue
            folder = index_folder(self.server, self.root, name)
            version = VectorStore.current_version(folder)
            loaded = self._loaded.get(name)
            if version is None or (loaded is not None and loaded.version == version):
                if version is None and loaded is None and name not in self._reported_missing:
                    self._reported_missing.add(name)
                    logger.warning("index %r is not built yet (%s): `inferline index build DOCS --name %s`; "
                                   "it loads when built", name, folder, name)
                continue
            store = VectorStore.load(folder / version, shared_embedder(spec.model, spec.device))
            self._loaded[name] = store  # the swap: one assignment
            swapped.append(name)
            logger.info("index %r: version %s loaded (%d chunks)", name, version, len(store.chunks))
        return swapped

    async def watch(self) -> None:
        """Refresh forever (cancel to stop); a failing refresh is logged and retried."""
        if not self.server.indexes:
            return
        every = min(spec.reload_every_s for spec in self.server.indexes.values())
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:  # a half-written or corrupt version must not stop the watcher
                logger.exception("index refresh failed; keeping the loaded versions")
