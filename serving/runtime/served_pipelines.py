"""The pipelines a process serves, by name: one object that every reader holds and only the hot reload changes.

The runtime, the app's executor, the pipeline caller (judges, sub-pipelines) and the refusal recorder read
it; :class:`~serving.runtime.reloader.PipelineReloader` swaps a new version in and retires a pipeline,
each in one step of the event loop, so that a request that holds a pipeline finishes on it and the next one
finds the new version.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from pipeline.runner import Pipeline


class ServedPipelines(Mapping[str, Pipeline]):
    """The served pipelines by name (their endpoints), read as a mapping; changed by :meth:`swap` and :meth:`retire`."""

    def __init__(self, pipelines: Iterable[Pipeline] = ()):
        self._by_name = {pipeline.name: pipeline for pipeline in pipelines}

    def __getitem__(self, name: str) -> Pipeline:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str, default: Pipeline | None = None) -> Pipeline | None:  # type: ignore[override]
        return self._by_name.get(name, default)  # every request's lookup: no KeyError on the way

    def swap(self, pipeline: Pipeline) -> Pipeline | None:
        """Serve *pipeline* under its name from now on; the version it replaces, if any (the caller closes it
        once its requests end)."""
        before = self._by_name.get(pipeline.name)
        self._by_name[pipeline.name] = pipeline
        return before

    def retire(self, name: str) -> Pipeline | None:
        """Stop serving *name* (new requests get 404); the pipeline it served, if any."""
        return self._by_name.pop(name, None)
