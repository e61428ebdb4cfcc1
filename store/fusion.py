"""Fusing the dense and keyword rankings of a hybrid search into one.

``rrf``: reciprocal rank fusion (Cormack, Clarke and Büttcher, 2009), as Elasticsearch, OpenSearch and
Haystack do it: a chunk scores ``sum(weight / (k + rank))`` over the rankings it is in (rank from 1), so it
needs no comparable scores; ``k`` (60) damps the lead of the first ranks.

``weighted``: each side's scores scaled to 0..1 by its own best and worst candidates, then summed with the
weights (Weaviate's relative score fusion): it keeps how much better the first candidate is than the
second, which rank fusion drops.

Ties are broken by the best rank a chunk had, then by its row, so the order is the same on every run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: A ranking: (row, score) best first.
Ranking = Sequence[tuple[int, float]]


def reciprocal_rank_fusion(rankings: Mapping[str, Ranking], k: int = 60,
                           weights: Mapping[str, float] | None = None) -> list[tuple[int, float]]:
    """The rows of every ranking, by their summed reciprocal ranks, best first."""
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for side, ranking in rankings.items():
        weight = 1.0 if weights is None else weights.get(side, 1.0)
        for rank, (row, _) in enumerate(ranking, start=1):
            scores[row] = scores.get(row, 0.0) + weight / (k + rank)
            best[row] = min(best.get(row, rank), rank)
    return _ordered(scores, best)


def weighted_fusion(rankings: Mapping[str, Ranking],
                    weights: Mapping[str, float] | None = None) -> list[tuple[int, float]]:
    """The rows of every ranking by the weighted sum of their min-max scaled scores, best first."""
    scores: dict[int, float] = {}
    best: dict[int, int] = {}
    for side, ranking in rankings.items():
        if not ranking:
            continue
        weight = 1.0 if weights is None else weights.get(side, 1.0)
        values = [score for _, score in ranking]
        low, high = min(values), max(values)
        for rank, (row, score) in enumerate(ranking, start=1):
            scaled = 1.0 if high == low else (score - low) / (high - low)
            scores[row] = scores.get(row, 0.0) + weight * scaled
            best[row] = min(best.get(row, rank), rank)
    return _ordered(scores, best)


def _ordered(scores: dict[int, float], best: dict[int, int]) -> list[tuple[int, float]]:
    return sorted(scores.items(), key=lambda item: (-item[1], best[item[0]], item[0]))


__all__ = ["Ranking", "reciprocal_rank_fusion", "weighted_fusion"]
