"""Pipeline versions: every pipeline file the server loaded, kept with its YAML text.

    versions = PipelineVersions(engine)
    versions.record(name="support", label="3", sha256=..., text=yaml_text, source="pipelines/support.yaml",
                    deployed_by="file")        # once per (name, sha256); later loads of it return the same row
    versions.by_sha256(sha)                     # the exact YAML that served an audit record (its spec_sha256)
    versions.list("support")                    # newest first
    versions.labelled("support", "3")           # those labelled 3: more than one, and a pin by label is ambiguous
    ToolPins(engine).pin("support", sha, {"answer/orders/order_status": schema_sha})  # the first pins hold

A version is identified by its spec hash: the SHA-256 of the YAML text, which audit records carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, Session, mapped_column

from store.db import Base, UTCDateTime, utcnow


class PipelineVersionRow(Base):
    """One version of a pipeline: the YAML text the server loaded, and who deployed it when."""

    __tablename__ = "pipeline_versions"
    __table_args__ = (sa.UniqueConstraint("name", "spec_sha256"),
                      sa.Index("ix_pipeline_versions_name_deployed_at", "name", "deployed_at"))

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    label: Mapped[str] = mapped_column(sa.String(64))
    """The pipeline's ``version:`` (free text the team chose; not unique)."""
    spec_sha256: Mapped[str] = mapped_column(sa.String(64), index=True)
    """SHA-256 of the YAML text: what audit records name as ``spec_sha256``."""
    text: Mapped[str] = mapped_column(sa.Text)
    source: Mapped[str] = mapped_column(sa.String(1000))
    """Where it came from: the file's path."""
    deployed_by: Mapped[str] = mapped_column(sa.String(200))
    """``file`` for a file the server loaded (at start or by a reload), else the key id that deployed it."""
    deployed_at: Mapped[datetime] = mapped_column(UTCDateTime())


@dataclass(frozen=True, slots=True)
class PipelineVersion:
    id: int
    name: str
    label: str
    spec_sha256: str
    text: str
    source: str
    deployed_by: str
    deployed_at: datetime

    @classmethod
    def of(cls, row: PipelineVersionRow) -> PipelineVersion:
        return cls(row.id, row.name, row.label, row.spec_sha256, row.text, row.source, row.deployed_by,
                   row.deployed_at)


def version_matches(label: str, sha256: str, version: str) -> bool:
    """Whether *version* names the version with this label and spec hash: its ``version:`` label, or six or
    more characters of its hash (what pins, splits, shadows and activations accept)."""
    return version == label or (len(version) >= 6 and sha256.startswith(version))


class PipelineVersions:
    """The ``pipeline_versions`` table."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def record(self, *, name: str, label: str, sha256: str, text: str, source: str,
               deployed_by: str = "file") -> PipelineVersion:
        """The version of *name* with this hash, recorded now unless it was before."""
        with Session(self.engine) as session:
            found = session.scalar(sa.select(PipelineVersionRow).where(
                PipelineVersionRow.name == name, PipelineVersionRow.spec_sha256 == sha256))
            if found is not None:
                return PipelineVersion.of(found)
            row = PipelineVersionRow(name=name, label=label, spec_sha256=sha256, text=text, source=source,
                                     deployed_by=deployed_by, deployed_at=utcnow())
            session.add(row)
            try:
                session.commit()
            except sa.exc.IntegrityError:  # another process recorded it first
                session.rollback()
                found = session.scalar(sa.select(PipelineVersionRow).where(
                    PipelineVersionRow.name == name, PipelineVersionRow.spec_sha256 == sha256))
                if found is None:
                    raise
                return PipelineVersion.of(found)
            return PipelineVersion.of(row)

    def by_sha256(self, sha256: str, name: str | None = None) -> PipelineVersion | None:
        """The version with this spec hash (of pipeline *name*, when given); None if never recorded."""
        query = sa.select(PipelineVersionRow).where(PipelineVersionRow.spec_sha256 == sha256)
        if name is not None:
            query = query.where(PipelineVersionRow.name == name)
        with Session(self.engine) as session:
            row = session.scalars(query.order_by(PipelineVersionRow.id)).first()
            return None if row is None else PipelineVersion.of(row)

    def labelled(self, name: str, label: str) -> list[PipelineVersion]:
        """The versions of *name* whose ``version:`` label is *label*, newest first: more than one, and a
        pin, split or shadow by that label is ambiguous."""
        query = (sa.select(PipelineVersionRow).where(PipelineVersionRow.name == name, PipelineVersionRow.label == label)
                 .order_by(PipelineVersionRow.id.desc()))
        with Session(self.engine) as session:
            return [PipelineVersion.of(row) for row in session.scalars(query)]

    def list(self, name: str | None = None, limit: int = 100) -> list[PipelineVersion]:
        """Versions, newest first (of pipeline *name*, when given)."""
        query = sa.select(PipelineVersionRow).order_by(PipelineVersionRow.id.desc()).limit(limit)
        if name is not None:
            query = query.where(PipelineVersionRow.name == name)
        with Session(self.engine) as session:
            return [PipelineVersion.of(row) for row in session.scalars(query)]


class PipelineTrafficRow(Base):
    """How a pipeline's requests are split between its versions (a canary); no row: the active one takes all."""

    __tablename__ = "pipeline_traffic"

    name: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    weights: Mapped[dict[str, int]] = mapped_column(sa.JSON)
    """Spec hash -> weight: each request goes to a version with probability weight / total, sticky per key."""
    updated_by: Mapped[str] = mapped_column(sa.String(200))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PipelineTraffic:
    """The ``pipeline_traffic`` table: every process serving the pipelines reads it on each reload pass."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def set(self, name: str, weights: dict[str, int] | None, updated_by: str) -> None:
        """Split *name*'s traffic by *weights* (spec hash -> weight); None: back to the active version alone."""
        with Session(self.engine) as session, session.begin():
            row = session.get(PipelineTrafficRow, name)
            if weights is None:
                if row is not None:
                    session.delete(row)
                return
            if row is None:
                session.add(PipelineTrafficRow(name=name, weights=dict(weights), updated_by=updated_by,
                                               updated_at=utcnow()))
            else:
                row.weights, row.updated_by, row.updated_at = dict(weights), updated_by, utcnow()

    def all(self) -> dict[str, dict[str, int]]:
        """Every split, by pipeline name."""
        with Session(self.engine) as session:
            return {row.name: dict(row.weights) for row in session.scalars(sa.select(PipelineTrafficRow))}


class PipelineShadowRow(Base):
    """A shadow: a share of a pipeline's requests also runs on a candidate version, whose answer is never sent."""

    __tablename__ = "pipeline_shadows"

    name: Mapped[str] = mapped_column(sa.String(200), primary_key=True)
    spec_sha256: Mapped[str] = mapped_column(sa.String(64))
    """The candidate version (a kept one)."""
    percent: Mapped[float] = mapped_column(sa.Float)
    """The share of the pipeline's answered requests that also run on the candidate, 0 to 100."""
    updated_by: Mapped[str] = mapped_column(sa.String(200))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


@dataclass(frozen=True, slots=True)
class Shadow:
    """Pipeline *name*'s shadow: *percent* of its requests also run on version *spec_sha256*."""

    spec_sha256: str
    percent: float


class PipelineShadows:
    """The ``pipeline_shadows`` table: every process serving the pipelines reads it on each reload pass."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def set(self, name: str, shadow: Shadow | None, updated_by: str) -> None:
        """Shadow *name*'s requests onto a candidate; None: no shadow."""
        with Session(self.engine) as session, session.begin():
            row = session.get(PipelineShadowRow, name)
            if shadow is None:
                if row is not None:
                    session.delete(row)
                return
            if row is None:
                session.add(PipelineShadowRow(name=name, spec_sha256=shadow.spec_sha256, percent=shadow.percent,
                                              updated_by=updated_by, updated_at=utcnow()))
            else:
                row.spec_sha256, row.percent = shadow.spec_sha256, shadow.percent
                row.updated_by, row.updated_at = updated_by, utcnow()

    def all(self) -> dict[str, Shadow]:
        """Every shadow, by pipeline name."""
        with Session(self.engine) as session:
            return {row.name: Shadow(row.spec_sha256, row.percent)
                    for row in session.scalars(sa.select(PipelineShadowRow))}


class ToolPinRow(Base):
    """The definition of one MCP tool a pipeline version was first loaded with (what its calls are held to)."""

    __tablename__ = "tool_pins"
    __table_args__ = (sa.UniqueConstraint("name", "spec_sha256", "tool"),)

    id: Mapped[int] = mapped_column(sa.Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    spec_sha256: Mapped[str] = mapped_column(sa.String(64))
    tool: Mapped[str] = mapped_column(sa.String(500))
    """``STEP/SERVER/TOOL``: the agent step, the MCP server and the tool."""
    schema_sha256: Mapped[str] = mapped_column(sa.String(64))
    """SHA-256 of the tool's definition as the server listed it then."""
    pinned_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ToolPins:
    """The ``tool_pins`` table: an MCP tool's definition is pinned with the pipeline version that first listed it,
    across reloads, restarts and servers, so that a server that changes it later is refused until a new version
    of the pipeline is deployed."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine

    def pin(self, name: str, spec_sha256: str, pins: Mapping[str, str]) -> dict[str, str]:
        """Keep *pins* (``STEP/SERVER/TOOL`` -> schema SHA-256) with the version where none is kept yet for that
        tool; the pins kept for those tools (the first ones: a later listing never replaces them)."""
        with Session(self.engine) as session:
            kept = self._kept(session, name, spec_sha256, pins)
            fresh = [ToolPinRow(name=name, spec_sha256=spec_sha256, tool=tool, schema_sha256=sha256,
                                pinned_at=utcnow()) for tool, sha256 in pins.items() if tool not in kept]
            if not fresh:
                return kept
            session.add_all(fresh)
            try:
                session.commit()
            except sa.exc.IntegrityError:  # another process pinned them first: its pins hold
                session.rollback()
                return self._kept(session, name, spec_sha256, pins)
            return kept | {row.tool: row.schema_sha256 for row in fresh}

    @staticmethod
    def _kept(session: Session, name: str, spec_sha256: str, pins: Mapping[str, str]) -> dict[str, str]:
        query = sa.select(ToolPinRow).where(ToolPinRow.name == name, ToolPinRow.spec_sha256 == spec_sha256,
                                            ToolPinRow.tool.in_(list(pins)))
        return {row.tool: row.schema_sha256 for row in session.scalars(query)}
