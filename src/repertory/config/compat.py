"""Reading configs written before the ``method`` section: recipes, ``--set`` keys and run directories' config.yaml.

Until 0.x one config carried every method's settings: ``trainer: online | rounds``, ``rounds.method`` and its
options, the estimator's knobs in ``algo`` (three names for the discount per turn), ``critic`` and ``pool``.
They now live in ``method`` (docs/design.md, The method section). A config in the old shape is translated
here, keeping only what its method used (what the old trainers read), so an old run resumes unchanged; a
``--set`` key of the old shape is renamed on the way in. ``method.kind`` set by ``--set`` keeps the settings
the new method shares with the old one (``gamma``, ``logs``, ``epochs``...) and drops the rest.
"""

from __future__ import annotations

from typing import Any

from repertory.algos import ESTIMATORS
from repertory.config.methods import METHOD_CONFIGS, online_kinds, round_kinds
from repertory.types import RepertoryError

OLD_SECTIONS = ("trainer", "rounds", "critic", "pool")
ESTIMATOR_KNOBS = (
    "estimator",
    "gamma_turn",
    "lambda_turn",
    "gamma_token",
    "lambda_token",
    "gamma",
    "lam",
    "grpo_scale",
    "ema_alpha",
    "ema_update",
    "turn_discount",
    "round_gamma",
    "aa_gamma",
    "aa_beta",
    "reward_constant",
    "discount_state_visitation",
    "strict",
    "whiten",
)
TURN_GAMMAS = ("gamma_turn", "turn_discount", "round_gamma")  # one quantity, three old names: now method.gamma
RENAMED = {
    ("rounds", "method"): ("method", "kind"),
    ("rounds", "sft_quantile"): ("method", "quantile"),
    ("rounds", "kto_beta"): ("method", "beta"),
    ("rounds", "q", "lora_r"): ("method", "q", "lora", "r"),
    ("rounds", "q", "lora_alpha"): ("method", "q", "lora", "alpha"),
    ("rounds", "q", "target_modules"): ("method", "q", "lora", "target_modules"),
    ("algo", "gamma"): ("method", "gamma_token"),  # gae's discount was per token
}


def _check_trainer(value: Any) -> None:
    if value not in ("online", "rounds"):
        raise RepertoryError(
            f"trainer: {value!r} names no loop; the trainer key is gone, the loop follows method.kind "
            f"({', '.join(online_kinds())}: online; {', '.join(round_kinds())}: rounds)"
        )


def kind_of(data: dict[str, Any]) -> str:
    """The method kind a (new-shape) config dict names; the default is self-play."""
    method = data.get("method")
    return str(method.get("kind", "selfplay")) if isinstance(method, dict) else "selfplay"


def new_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where an old key lives now (unchanged for keys that did not move)."""
    if path in RENAMED:
        return RENAMED[path]
    head, rest = path[0], path[1:]
    if head == "algo" and rest and rest[0] in TURN_GAMMAS:
        return ("method", "gamma")
    if head == "algo" and rest and rest[0] in ESTIMATOR_KNOBS:
        return ("method", *rest)
    if head == "rounds" and rest[:1] == ("archer",):
        return ("method", *rest[1:])
    if head in ("rounds", "critic", "pool"):
        return ("method", *rest) if head == "rounds" else ("method", head, *rest)
    return path


def switch_kind(data: dict[str, Any], kind: Any) -> None:
    """Set ``method.kind``, keeping the settings the new kind shares with the current one."""
    method = data.get("method")
    method = dict(method) if isinstance(method, dict) else {}
    if method.get("kind", "selfplay") != kind and kind in METHOD_CONFIGS:
        fields = METHOD_CONFIGS[kind].model_fields
        method = {k: v for k, v in method.items() if k in fields}
    data["method"] = {**method, "kind": kind}


def translate_override(path: list[str], value: Any, data: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """An old-shape ``--set`` key as new-shape ones, read against ``data`` (the config so far)."""
    key = tuple(path)
    if key == ("trainer",):
        _check_trainer(value)
        rounds = kind_of(data) not in online_kinds()
        if value == "rounds" and not rounds:
            return [(["method", "kind"], "igrpo")]
        if value == "online" and rounds:
            return [(["method", "kind"], "selfplay")]
        return []
    if key == ("algo", "estimator") and value in ESTIMATORS:
        kind = "adalign" if ESTIMATORS[value].family == "alignment" else "selfplay"
        return [(["method", "kind"], kind), (["method", "estimator"], value)]
    return [(list(new_path(key)), value)]


def leaves(node: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every non-dict value of a nested dict (an empty dict counts as a value), with its key path."""
    out = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out += leaves(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out


def _old_kind(data: dict[str, Any]) -> str:
    rounds = data.get("rounds") if isinstance(data.get("rounds"), dict) else {}
    if "trainer" in data:
        _check_trainer(data["trainer"])
    if data.get("trainer") == "rounds":
        return str(rounds.get("method", "igrpo"))
    algo = data.get("algo") if isinstance(data.get("algo"), dict) else {}
    estimator = algo.get("estimator", "omar")
    return "adalign" if estimator in ESTIMATORS and ESTIMATORS[estimator].family == "alignment" else "selfplay"


def _gamma_sources(kind: str, estimator: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The old keys that held this method's discount per turn and per token."""
    if kind not in online_kinds():
        return ("rounds", "gamma"), ("algo", "gamma")
    if kind == "adalign":
        return ("algo", "round_gamma"), ("algo", "gamma_token")
    turn = ("algo", "gamma_turn") if estimator == "omar" else ("algo", "turn_discount")
    return turn, ("algo", "gamma") if estimator == "gae" else ("algo", "gamma_token")


def is_old(data: dict[str, Any]) -> bool:
    """Whether a config dict has keys of the shape before the ``method`` section."""
    algo = data.get("algo")
    return any(k in data for k in OLD_SECTIONS) or (isinstance(algo, dict) and any(k in algo for k in ESTIMATOR_KNOBS))


def translate(data: dict[str, Any]) -> dict[str, Any]:
    """A whole config dict in the old shape as the new one (unchanged if it has no old key): the method its
    ``trainer``, ``rounds.method`` and ``algo.estimator`` named, with the settings that method read."""
    if not is_old(data):
        return data
    kind = kind_of(data) if isinstance(data.get("method"), dict) else _old_kind(data)
    algo = data.get("algo") if isinstance(data.get("algo"), dict) else {}
    turn, token = _gamma_sources(kind, str(algo.get("estimator", "omar")))
    fields = METHOD_CONFIGS[kind].model_fields if kind in METHOD_CONFIGS else {}
    method: dict[str, Any] = {"kind": kind}
    for path, value in leaves({k: data[k] for k in ("algo", "rounds", "critic", "pool") if k in data}):
        if value is None or path == ("rounds", "method") or path[0] == "algo" and path[1] not in ESTIMATOR_KNOBS:
            continue  # null meant the default then as now
        if kind.startswith("archer") and path == ("rounds", "batch_size"):
            continue  # archer read rounds.archer.batch_size
        if path[-1] in (*TURN_GAMMAS, "gamma") and path not in (turn, token):
            continue  # another estimator's discount: the old trainer never read it
        if path[1:] == ("gamma_token",) and token != ("algo", "gamma_token"):
            continue
        target = ("method", "gamma") if path == turn else new_path(path)
        if kind == "archer-lc" and target[:3] == ("method", "q", "lora"):
            target = ("method", *target[2:])  # archer-lc's critic adapter had the Q-function's shape
        if target[1] in fields:
            node = method
            for part in target[1:-1]:
                node = node.setdefault(part, {})
            node[target[-1]] = value
    new = {k: v for k, v in data.items() if k not in OLD_SECTIONS}
    if algo:
        new["algo"] = {k: v for k, v in algo.items() if k not in ESTIMATOR_KNOBS}
    new["method"] = {**method, **(data.get("method") or {})}
    return new
