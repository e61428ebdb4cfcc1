"""Evaluation runs and their cases (store.eval_runs: ``inferline eval``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _utc() -> sa.DateTime:
    # store.db.UTCDateTime stores through this type; the revision must not import model code.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("pipeline", sa.String(200), nullable=False),
        sa.Column("pipeline_version", sa.String(64), nullable=False),
        sa.Column("spec_sha256", sa.String(64), nullable=False),
        sa.Column("dataset", sa.String(500), nullable=False),
        sa.Column("dataset_sha256", sa.String(64), nullable=False),
        sa.Column("num_cases", sa.Integer(), nullable=False),
        sa.Column("pass_rate", sa.Float(), nullable=False),
        sa.Column("baseline_id", sa.String(36), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eval_runs")),
    )
    op.create_index("ix_eval_runs_pipeline_created_at", "eval_runs", ["pipeline", "created_at"])
    op.create_table(
        "eval_results",
        sa.Column("run_id", sa.String(36), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("case_id", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("checks", sa.JSON(), nullable=False),
        sa.Column("output", sa.Text(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("itl_ms", sa.Float(), nullable=True),
        sa.Column("e2e_ms", sa.Float(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cost_usd", sa.Float(), nullable=False),
        sa.Column("request_id", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["eval_runs.id"], ondelete="CASCADE",
                                name=op.f("fk_eval_results_run_id_eval_runs")),
        sa.PrimaryKeyConstraint("run_id", "position", name=op.f("pk_eval_results")),
    )


def downgrade() -> None:
    op.drop_table("eval_results")
    op.drop_index("ix_eval_runs_pipeline_created_at", table_name="eval_runs")
    op.drop_table("eval_runs")
