"""Offline evaluation: ``inferline eval PIPELINE --dataset FILE.jsonl``.

``dataset`` reads the cases (located errors), ``runtime`` opens a pipeline in-process as
``inferline run`` does, ``harness`` runs the cases concurrently through it and checks the
answers (stages/checks.py), ``report`` summarises a run and compares it with a baseline,
``cli`` is the command; runs are stored by store/eval_runs.py.
"""
