"""Advantage estimation: what estimators read and return, and the registry that names them.

An estimator turns the per-turn rewards (and, for critic estimators, per-token values) of trainable seats into
per-token advantages. Estimators are pure functions over plain lists of Python floats (float64 math) in
:mod:`repertory.algos.estimators`; the only state they touch is the trainer-owned, JSON-serialisable ``state``
dict of the EMA baselines. This package imports no torch, so configs validate estimator names without it. The
per-token torch losses and their registry are :mod:`repertory.algos.losses`; the batch-online math of
Iterative GRPO and its baselines is :mod:`repertory.algos.offline`. Section numbers refer to docs/algorithms.md.
"""

from __future__ import annotations

from typing import Literal, get_args

from repertory.algos.estimators import (
    ESTIMATORS,
    AlignmentParams,
    Estimate,
    EstimatorParams,
    EstimatorSpec,
    GaeParams,
    TrajectoryInput,
    TurnParams,
    aa_credits,
    discounted_returns,
    get_estimator,
    group_normalise,
    register_estimator,
    whiten,
)

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
"""How per-token losses are averaged over a mini-batch (docs/algorithms.md 2.7; ``algos.losses`` weighs them)."""
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

__all__ = [
    "AGGREGATIONS",
    "AlignmentParams",
    "ESTIMATORS",
    "Aggregation",
    "Estimate",
    "EstimatorParams",
    "EstimatorSpec",
    "GaeParams",
    "TrajectoryInput",
    "TurnParams",
    "aa_credits",
    "discounted_returns",
    "get_estimator",
    "group_normalise",
    "register_estimator",
    "whiten",
]
