"""``report/index.html``: one self-contained page per run (no server, no network; it opens from ``file://``).

The page holds the learning curves (the series the PNG figures draw, split by scale), the resolved config, the
held-out evaluations of the metrics lines with a headline (the held-out outcome before the first update and after
the last, the rise in standard errors, and beside it the change in the game's key behaviour, its
:class:`~repertory.envs.KeyMetric`), any cross-play results saved into the run (``crossplay-ENV.json``), and an
episode browser: every seat's transcript as that seat saw it, with channels, invalid actions and the referee's
reason, rewards and, for trained turns, the advantage and return the estimator gave (``credit/``). The browser
holds the training episodes and the final held-out evaluation's games (``heldout/``), the trained policy playing.
Large runs are sampled evenly across iterations so the file stays under :data:`MAX_BYTES`.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from repertory.envs import KeyMetric, env_class
from repertory.report.metrics import (
    FIGURES,
    J_IS_ZERO,
    behaviour_change,
    held_out_change,
    is_standard_error,
    metric_series,
    read_metrics,
    scale_title,
    split_by_scale,
    with_final,
)
from repertory.runs import RunDir, load_run_config
from repertory.store import StoreError, read_credit, read_episodes
from repertory.types import Episode, Message, RepertoryError, message_dicts

MAX_EPISODES = 300
"""Episodes the browser shows by default; a run with more is sampled evenly across its iterations."""
MAX_BYTES = 20 * 1024 * 1024
"""The page's size bound: a page that would pass it keeps the share of its episode sample that fits."""
MAX_MESSAGE_CHARS = 6000
"""A longer message is cut in the page (the episode files keep it whole), marked with how much was cut."""

_PLACEHOLDER = re.compile(r"\{\{(TITLE|STYLE|DATA|SCRIPT)\}\}")

Credit = dict[tuple[str, str, int], tuple[float, float | None]]


def _clip(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[:MAX_MESSAGE_CHARS] + f"\n[... {len(text) - MAX_MESSAGE_CHARS} more characters in the episode file]"


def _messages(messages: list[Message]) -> list[dict[str, str]]:
    return [{**row, "content": _clip(row["content"])} for row in message_dicts(messages)]


def episode_record(ep: Episode, credit: Credit) -> dict[str, Any]:
    """One episode as the page's browser reads it."""
    names = {s.seat_id: s.name for s in ep.seats}
    turns = []
    for t in ep.turns:
        adv, ret = credit.get((ep.episode_id, t.seat_id, t.turn_index), (None, None))
        turns.append(
            {
                "seat": names[t.seat_id],
                "index": t.turn_index,
                "step": t.global_step,
                "round": t.game_round,
                "seen": _messages(t.observation),
                "text": _clip(t.text),
                "action": None if t.action is None else f"{t.action.tag} {json.dumps(t.action.value)}",
                "invalid": t.invalid,
                "error": t.error,
                "reward": t.reward,
                "finish": t.finish,
                "advantage": adv,
                "return": ret,
            }
        )
    return {
        "id": ep.episode_id,
        "iteration": ep.iteration,
        "env": ep.env,
        "kernel": ep.kernel.id,
        "split": ep.kernel.split,
        "seats": [
            {"name": s.name, "role": s.role, "agent": s.agent, "trainable": s.trainable, "seat_id": s.seat_id}
            for s in ep.seats
        ],
        "results": {
            name: {"points": r.points, "outcome": r.outcome, "turns": r.n_turns, "invalid": r.n_invalid}
            for name, r in ep.result.roles.items()
        },
        "end": ep.result.end_reason,
        "metrics": ep.metrics,
        "turns": turns,
        "final": {names.get(seat, seat): _messages(m) for seat, m in ep.final_observations.items()},
    }


def sample_evenly(items_per_group: list[list[Any]], limit: int) -> list[Any]:
    """``limit`` items (all of them when they fit) at evenly spaced positions of the groups laid end to end, in
    order: the middle of each of ``limit`` equal stretches, so every group keeps its share and the last ones
    count as much as the first."""
    flat = [item for group in items_per_group for item in group]
    if len(flat) <= limit:
        return flat
    return [flat[(2 * i + 1) * len(flat) // (2 * limit)] for i in range(limit)]


def _evaluations(lines: list[dict[str, Any]], gamma: float | None) -> dict[str, Any]:
    """The held-out evaluations of the metrics lines: one row per evaluated iteration (``final/*`` one later),
    and a note on J at the run's ``gamma``; at 0 J is left out, being 0 whatever the policy did."""
    rows = []
    for line in with_final(lines):
        values = {k[5:]: v for k, v in line.items() if k.startswith("eval/") and isinstance(v, (int, float))}
        if gamma == 0:  # the validation evaluation's J too
            values = {
                k: v for k, v in values.items() if not k.removeprefix("validation/").startswith("discounted_return")
            }
        if values:
            rows.append({"iteration": line["iteration"], **values})
    columns = sorted({k for row in rows for k in row if k != "iteration" and not is_standard_error(k)}, key=_eval_order)
    note = ""
    if gamma == 0:
        note = f"discounted_return (J) is left out: this run's method.gamma is 0, and {J_IS_ZERO}."
    elif gamma is not None and "discounted_return" in columns:
        note = f"discounted_return is J, the expected return discounted by method.gamma = {gamma:g} per own turn."
    return {"columns": columns, "rows": rows, "note": note}


def _eval_order(key: str) -> tuple[int, str]:
    for rank, prefix in enumerate(("outcome", "discounted_return", "invalid_rate", "team/", "judge", "env/")):
        if key.startswith(prefix):
            return rank, key
    return 9, key


@dataclass(frozen=True)
class _RunFacts:
    """What the page reads from the run's config: the evaluation line-up, the game's key metric, J's gamma."""

    opponent: str | None = None
    key_metric: KeyMetric | None = None
    gamma: float | None = None


def _run_facts(run_dir: RunDir, warnings: list[str]) -> _RunFacts:
    if not run_dir.is_run():
        return _RunFacts()
    try:
        config = load_run_config(run_dir.config)
        return _RunFacts(config.evaluation_opponent, env_class(config.rollout.env).key_metric, config.method.gamma)
    except RepertoryError as exc:
        warnings.append(f"{run_dir.config}: the game and the evaluation line-up are unknown ({exc})")
        return _RunFacts()


def _headline(lines: list[dict[str, Any]], facts: _RunFacts) -> dict[str, Any] | None:
    """The held-out outcome before the first update and after the last, against the evaluation line-up."""
    change = held_out_change(lines)
    if change is None:
        return None
    return {
        "opponent": facts.opponent,
        **dataclasses.asdict(change),
        "rise": change.rise,
        "standard_errors": change.standard_errors,
    }


def _behaviour(lines: list[dict[str, Any]], facts: _RunFacts) -> dict[str, Any] | None:
    """The change in the game's key behaviour between the first and the last held-out evaluation."""
    change = behaviour_change(lines, facts.key_metric) if facts.key_metric is not None else None
    if change is None:
        return None
    return {
        **dataclasses.asdict(change),
        "metric": change.metric.name,
        "label": change.metric.label,
        "change": change.change,
        "verdict": change.verdict,
    }


def _crossplay(run_dir: RunDir, warnings: list[str]) -> list[dict[str, Any]]:
    """The cross-play results saved in the run; a file that is not one becomes a warning."""
    out = []
    for path in run_dir.crossplay_results():
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            warnings.append(f"{path}: not a readable cross-play result ({exc})")
            continue
        agents = data.get("agents") if isinstance(data, dict) else None
        matrix = data.get("M") if isinstance(data, dict) else None
        if not (isinstance(agents, list) and isinstance(matrix, dict) and all(a in matrix for a in agents)):
            warnings.append(f"{path}: not a cross-play result (no agents and M matrix)")
            continue
        out.append({"file": path.name, **data})
    return out


def _figures(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learning curves, one chart per figure and scale (:func:`split_by_scale`), only series with points."""
    figures = []
    for filename, (title, prefixes) in FIGURES.items():
        series = metric_series(with_final(lines), prefixes)
        groups = split_by_scale(series) if series else []
        for i, group in enumerate(groups):
            figures.append(
                {
                    "id": filename.removesuffix(".png") + (f"-{i + 1}" if i else ""),
                    "title": scale_title(title, group, len(groups)),
                    "series": {key: [[x, y] for x, y in zip(xs, ys)] for key, (xs, ys) in group.items()},
                }
            )
    return figures


def _read(paths: list[Path], warnings: list[str]) -> list[list[Episode]]:
    """The episodes of each readable file; each unreadable one becomes a warning."""
    out = []
    for path in paths:
        try:
            out.append(read_episodes(path))
        except StoreError as exc:
            warnings.append(str(exc))
    return out


def _final_games(run_dir: RunDir, lines: list[dict[str, Any]], warnings: list[str]) -> list[Episode]:
    """The games of the evaluation after the last update (``final/*`` of the metrics lines), where kept."""
    done = [line["iteration"] + 1 for line in lines if any(k.startswith("final/") for k in line)]
    if not done or not run_dir.heldout(done[-1]).is_file():
        return []
    return [ep for games in _read([run_dir.heldout(done[-1])], warnings) for ep in games]


def _episodes(
    run_dir: RunDir, lines: list[dict[str, Any]], limit: int, warnings: list[str]
) -> tuple[list[dict[str, Any]], int]:
    """An even sample of at most ``limit`` episodes as the browser reads them, the final held-out games with up
    to half of it (so a long run still shows the trained policy), and how many episodes the run has."""
    credit: Credit = {}
    for path in run_dir.iteration_files("credit"):
        try:
            credit.update(read_credit(path))
        except StoreError as exc:
            warnings.append(str(exc))
    training = _read(run_dir.iteration_files("episodes"), warnings)
    final = _final_games(run_dir, lines, warnings)
    shown = sample_evenly(training, limit - min(len(final), limit // 2))
    records = [{**episode_record(ep, credit), "source": "training"} for ep in shown]
    records += [{**episode_record(ep, {}), "source": "final"} for ep in sample_evenly([final], limit - len(shown))]
    return records, sum(len(g) for g in training) + len(final)


def page_data(run_dir: str | os.PathLike[str], max_episodes: int = MAX_EPISODES) -> tuple[dict[str, Any], list[str]]:
    """Everything the page shows, and one warning per file that could not be read (the rest still shows)."""
    run_dir = RunDir(run_dir)
    warnings: list[str] = []
    lines = read_metrics(run_dir)
    facts = _run_facts(run_dir, warnings)
    episodes, total = _episodes(run_dir, lines, max_episodes, warnings)
    data = {
        "run": run_dir.root.resolve().name,
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": run_dir.config.read_text() if run_dir.is_run() else "",
        "figures": _figures(lines),
        "headline": _headline(lines, facts),
        "behaviour": _behaviour(lines, facts),
        "evaluations": _evaluations(lines, facts.gamma),
        "crossplay": _crossplay(run_dir, warnings),
        "episodes": episodes,
        "episodes_total": total,
        "warnings": warnings,
    }
    return data, warnings


def _asset(name: str) -> str:
    return resources.files("repertory.report").joinpath(name).read_text()


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None (JSON has no such numbers; the page shows them as gaps)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def render_page(data: dict[str, Any]) -> str:
    """The page's HTML: the viewer's style and script inline, the data as a JSON script element."""
    # "<" escaped as \u003c keeps any "</script>" inside transcripts from ending the data element.
    payload = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    values = {
        "TITLE": html.escape(f"repertory · {data['run']}"),
        "STYLE": _asset("viewer.css"),
        "DATA": payload,
        "SCRIPT": _asset("viewer.js"),
    }
    # One pass over the template: text inside the values (a transcript quoting "{{SCRIPT}}") is never replaced.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _asset("viewer.html"))


def write_page(run_dir: str | os.PathLike[str], max_episodes: int = MAX_EPISODES) -> tuple[Path, list[str]]:
    """Write ``RUN/report/index.html`` atomically; returns its path and the warnings of unreadable files."""
    if max_episodes < 0:
        raise RepertoryError(f"max_episodes must be at least 0 (got {max_episodes})")
    run_dir = RunDir(run_dir)
    data, warnings = page_data(run_dir, max_episodes)
    text = render_page(data)
    size = len(text.encode())
    while size > MAX_BYTES and data["episodes"]:
        # Episodes make up nearly all of a large page: keep the share that fits, with a margin, evenly spaced.
        shown = data["episodes"]
        keep = min(len(shown) - 1, int(len(shown) * MAX_BYTES / size * 0.95))
        data["episodes"] = sample_evenly([shown], keep)
        text = render_page(data)
        size = len(text.encode())
    path = run_dir.page
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path, warnings
