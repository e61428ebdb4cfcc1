"""Offline evaluation: ``inferline eval PIPELINE --dataset FILE.jsonl``.

``dataset`` reads the cases (located errors), ``harness`` runs them concurrently through a
pipeline opened in-process (``serving.runtime.resources.Runtime``) and checks the answers
(stages/checks.py), ``report`` summarises a run and compares it with a baseline; the command
is ``serving.cli.eval``; runs are stored by store/eval_runs.py. ``retrieval`` scores an index's search
modes on labeled questions (``inferline eval retrieval INDEX DATASET.jsonl``: recall@k, MRR, nDCG@10).

May import ``serving.http`` and below; not the console, capacity or the CLI.
"""
