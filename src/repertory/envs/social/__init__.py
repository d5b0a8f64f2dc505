"""Social scenarios in the SOTOPIA style (docs/environments.md 12): open conversations of two or three people.

Each kernel is one scenario of the catalogue (:mod:`repertory.envs.social.catalogue`) with profiles seated in
its slots, written out whole so that a kernel needs nothing else to be played. Turns go round-robin over the
people still present; a turn is speech, a non-verbal sign, a physical action, leaving, or staying idle.
Scenarios with an agreement check also take ``<propose>`` and ``<accept/>``. The episode ends after
``max_turns`` turns, when fewer than two people remain, or after three idle turns in a row.

Rewards (option ``reward``): ``verifiable`` scores the catalogue's goal check alone, with no judge and no
network; ``judge`` waits for a judge's seven scores per agent (the rollout engine batches the requests of
the episodes that finish in a tick); ``hybrid`` takes the judge's scores with the goal and secret scales
replaced by the checks where the scenario has them.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError

from repertory.envs.base import Bot, Env, KeyMetric
from repertory.envs.grammar import Syntax
from repertory.envs.kernels import SPLITS, generate_kernels
from repertory.envs.parsing import PayloadError, clean, find_tags, parse_fields
from repertory.envs.social import catalogue
from repertory.envs.social.catalogue import RELATIONSHIPS, FieldSpec
from repertory.types import Action, Dimension, JudgeRequest, Kernel, Parsed, RepertoryError, Result, StepResult, Verdict

REWARDS = ("verifiable", "judge", "hybrid")
MAX_TURNS = 20
MAX_IDLE = 3
SOCIAL_TAGS = frozenset({"nonverbal", "act"})
EMPTY_TAGS = frozenset({"leave", "pass"})
AGREEMENT_TAGS = frozenset({"accept"})

DIMENSIONS = (
    Dimension("goal", 0, 10, "how fully the agent reached its private goal"),
    Dimension("believability", 0, 10, "how natural and in character the agent behaved"),
    Dimension("knowledge", 0, 10, "how much new, relevant information the agent gained"),
    Dimension("secret", -10, 0, "0 if the agent kept its secret; lower the more it leaked (0 if it had none)"),
    Dimension("social_rules", -10, 0, "0 if the agent broke no social norm or law; lower for each violation"),
    Dimension("relationship", -5, 5, "how the agent's relationships changed: negative if harmed, positive if improved"),
    Dimension("financial_and_material_benefits", -5, 5, "the agent's material gain (positive) or loss (negative)"),
)
FINE_GRAINED = (
    Dimension("compromise_seeking", 0, 10, "offers or accepts a middle ground"),
    Dimension("persuasion", 0, 10, "uses reasons to move the others"),
    Dimension("strategic_commitment", 0, 10, "makes and keeps commitments that shape the result"),
    Dimension("empathy_expression", 0, 10, "acknowledges the others' feelings"),
    Dimension("mutual_benefit_seeking", 0, 10, "looks for options that are good for everyone"),
)
JUDGE_INSTRUCTIONS = (
    "You evaluate one conversation between the agents below. You know every agent's private goal and secret; "
    "the agents did not know each other's. Score each agent on every dimension with an integer in its range."
)
FINE_INSTRUCTIONS = (
    "You evaluate how each agent below behaved in one conversation. Score each agent on every dimension."
)


def outcome_of(scores: dict[str, float]) -> float:
    """docs/environments.md 12: (sum of the seven scores + 30) / 70, in [0, 1]."""
    return (sum(scores[d.name] for d in DIMENSIONS) + 30) / 70


def overall_of(scores: dict[str, float]) -> float:
    """The plain mean of the seven scores."""
    return sum(scores[d.name] for d in DIMENSIONS) / len(DIMENSIONS)


def _kernel_data(scenario: catalogue.Scenario, profiles: list[catalogue.Profile]) -> dict[str, Any]:
    return {
        "scenario": scenario.model_dump(mode="json", exclude={"split"}),
        "profiles": [p.model_dump(mode="json") for p in profiles],
    }


def _draw(cat: catalogue.Catalogue, rng: random.Random, split: str) -> dict[str, Any]:
    """Kernel data: ``choice(pool)`` for the scenario, then one ``choice`` per slot among the eligible profiles
    not yet seated (each slot has its own constraints, so one ``sample`` over all slots cannot honour them)."""
    pool = cat.pool(split)
    if not pool:
        raise ValueError(f"the catalogue has no {split} scenarios")
    scenario = rng.choice(pool)
    seated: list[catalogue.Profile] = []
    for slot in scenario.slots:
        free = [p for p in cat.eligible(slot) if p not in seated]
        seated.append(rng.choice(free))
    return _kernel_data(scenario, seated)


@cache
def _user_kernels(directory: str, with_builtin: bool) -> dict[str, list[Kernel]]:
    """Every split's kernels of a user's catalogue, none for a split without scenarios (the pools are disjoint)."""
    cat = catalogue.load(directory, with_builtin)
    kernels = generate_kernels(Social, draw=lambda r, s: _draw(cat, r, s), splits=tuple(filter(cat.pool, SPLITS)))
    return {split: kernels.get(split, []) for split in SPLITS}


def agreeable(view: dict[str, Any]) -> str:
    """A scripted partner: leaves once an agreement meets its own conditions; accepts a standing proposal that
    does; else proposes it again with each field that breaks them moved to the nearest value that does. Where
    the scenario has no agreement it makes a short friendly remark."""
    fields, conditions = view["fields"], view["conditions"]
    if not fields:
        return "I see your point. Let us find something that works for both of us."
    if view["agreement"] is not None and catalogue.meets(view["agreement"], conditions):
        return "Glad we settled it. Goodbye! <leave/>"
    standing = view["standing"]
    if standing is not None and standing["by"] != view["role"] and catalogue.meets(standing["offer"], conditions):
        return "That works for me. <accept/>"
    base = standing["offer"] if standing is not None else {}
    offer = {}
    for name, spec in fields.items():
        field = FieldSpec.model_validate(spec)
        mine = [c for c in conditions if c[0] == name]
        current = base.get(name, field.min if field.is_int else (field.enum or [None])[0])
        candidates: list[Any] = list(field.enum or [])
        if field.is_int:
            assert field.min is not None and field.max is not None
            named = [v for c in mine for v in (c[2] if isinstance(c[2], list) else [c[2]])]
            bounds = {field.min, field.max, current} | {v for v in named if isinstance(v, int)}
            near = {b + d for b in bounds for d in (-1, 1) if field.min <= b + d <= field.max}
            candidates = sorted(bounds | near, key=lambda v: (abs(v - current), v))
        else:
            candidates.sort(key=lambda v: v != current)
        fitting = [v for v in candidates if all(catalogue.holds(v, op, t) for _, op, t in mine)]
        offer[name] = (fitting or candidates)[0]
    return f"How about this? <propose>{json.dumps(offer)}</propose>"


def quiet(view: dict[str, Any]) -> str:
    """A scripted seat that never says anything (every turn idle)."""
    return ""


class Social(Env):
    name = "social"
    description = "Social scenarios: 2-3 people with profiles and private goals; goal checks or an LLM judge."
    roles = ("p0", "p1", "p2")
    """The most seats a scenario has; a two-person scenario seats the first two agents of a line-up."""
    role_labels = ("agent", "agent", "agent")
    default_trained_role = "p0"
    scored_by_label = True
    missing_splits: ClassVar[dict[str, str]] = {
        "validation": "the shipped catalogue has train and held-out scenarios only, none for a disjoint validation "
        "split; give a scenarios directory (env_options scenarios: DIR) with scenarios marked split: validation"
    }
    bots: ClassVar[dict[str, Bot]] = {"agreeable": agreeable, "quiet": quiet}
    key_metric = KeyMetric("goal_verified", "goals met", "it meets its goal more often", "it meets its goal less often")

    def __init__(
        self,
        reward: str = "verifiable",
        scenarios: str | None = None,
        builtin_scenarios: bool = True,
        max_turns: int = MAX_TURNS,
    ):
        """``reward``: verifiable, judge or hybrid; ``scenarios``: a directory of the user's catalogue files, whose
        kernels replace the shipped ones (with the shipped scenarios too unless ``builtin_scenarios`` is false);
        ``max_turns``: turns in all before the conversation ends."""
        super().__init__()
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {', '.join(REWARDS)}, not {reward!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be a positive integer, not {max_turns!r}")
        if scenarios is not None:
            try:
                _user_kernels(str(Path(scenarios).resolve()), builtin_scenarios)
            except RepertoryError as exc:
                raise ValueError(str(exc)) from None
        elif not builtin_scenarios:
            raise ValueError("builtin_scenarios: false needs a scenarios directory")
        self.reward = reward
        self.max_turns = max_turns
        self._fields: dict[str, FieldSpec] = {}
        self._fields_of: Kernel | None = None

    # -- kernels ----------------------------------------------------------------------------------

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        """A train kernel of the shipped catalogue (``draw_kernel`` picks the split's pool)."""
        return cls.draw_kernel(rng, "train")

    @classmethod
    def draw_kernel(cls, rng: random.Random, split: str) -> dict[str, Any]:
        return _draw(catalogue.builtin(), rng, split)

    @classmethod
    def custom_kernels(cls, split: str, options: dict[str, Any]) -> list[Kernel] | None:
        directory = options.get("scenarios")
        if directory is None:
            return None
        with_builtin = bool(options.get("builtin_scenarios", True))
        try:
            kernels = _user_kernels(str(Path(directory).resolve()), with_builtin)
        except RepertoryError as exc:
            raise ValueError(str(exc)) from None
        if not kernels[split]:
            shipped = " (the shipped ones left out)" if not with_builtin else ""
            raise ValueError(f"the scenarios of {directory}{shipped} have no {split} scenario")
        return kernels[split]

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            scenario = catalogue.Scenario.model_validate(data.get("scenario"))
            profiles = [catalogue.Profile.model_validate(p) for p in data.get("profiles") or []]
        except ValidationError as exc:
            first = exc.errors()[0]
            return [f"{'.'.join(map(str, first['loc']))}: {first['msg']}"]
        if len(profiles) != len(scenario.slots):
            return [f"{len(scenario.slots)} slots but {len(profiles)} profiles"]
        if len({p.name for p in profiles}) != len(profiles):
            return ["two seated profiles share a name"]
        return []

    @classmethod
    def seat_names(cls, data: dict[str, Any]) -> tuple[str, ...]:
        return tuple(f"{p['first_name']} {p['last_name']}" for p in data["profiles"])

    @classmethod
    def seat_labels(cls, data: dict[str, Any]) -> tuple[str, ...]:
        return tuple(s["label"] for s in data["scenario"]["slots"])

    # -- state ------------------------------------------------------------------------------------

    @property
    def scenario(self) -> dict[str, Any]:
        assert self.kernel is not None
        return self.kernel.data["scenario"]

    @property
    def fields(self) -> dict[str, FieldSpec]:
        """The agreement's fields (none without a check), validated once per kernel: every parse reads them."""
        if self._fields_of is not self.kernel:
            agreement = (self.scenario.get("check") or {}).get("agreement")
            self._fields = {k: FieldSpec.model_validate(v) for k, v in (agreement or {}).get("fields", {}).items()}
            self._fields_of = self.kernel
        return self._fields

    def label(self, role: str) -> str:
        return self.role_labels[self.seat_index(role)]

    def _start(self) -> None:
        self.present = list(self.roles)
        self.turn = 0
        self.idle_run = 0
        self.next_seat = 0
        self.standing: dict[str, Any] | None = None
        self.accepted: set[str] = set()
        self.agreement: dict[str, Any] | None = None
        self.agreement_turn = 0
        self.transcript: list[tuple[int | None, str]] = []  # (turn, text) as the judge reads it
        self.own_texts: dict[str, list[str]] = {r: [] for r in self.roles}
        self.verdict: Verdict | None = None
        self.fine: Verdict | None = None
        self.judge_failed = False
        self.clipped = 0
        self._judged = False
        self.tell(self.roles[0], f"The conversation begins. You speak first. (Turn 1 of {self.max_turns}.)")

    @property
    def done(self) -> bool:
        return bool(self.end_reason)

    def acting_roles(self) -> list[str]:
        return [] if self.done else [self.roles[self.next_seat]]

    @property
    def game_round(self) -> int:
        return self.turn + (0 if self.done else 1)

    # -- prompts ----------------------------------------------------------------------------------

    def system_prompt(self, role: str) -> str:
        assert self.kernel is not None
        data, seat = self.kernel.data, self.seat_index(role)
        me, slot = data["profiles"][seat], data["scenario"]["slots"][seat]
        relationship = data["scenario"]["relationship"]
        others = []
        for i, p in enumerate(data["profiles"]):
            if i == seat:
                continue
            line = f"- {p['first_name']} {p['last_name']}, {p['age']}, {p['pronoun']}, {p['occupation']}."
            if relationship >= 2:
                line += f" {p['bio']}"
            others.append(line)
        traits = ", ".join(f"{k} {v}" for k, v in me["big_five"].items())
        secrets = [s for s in (slot.get("secret"), me.get("secret")) if s]
        lines = [
            f"You are {role}, {me['age']}, {me['pronoun']}, {me['occupation']}. {me['bio']}",
            f"Personality: {traits}. You value {', '.join(me['values'])}; your decision style is "
            f"{me['decision_style']}.",
            "",
            f"Situation: {data['scenario']['text']}",
            f"Your part: the {slot['label']}. The others are {RELATIONSHIPS[relationship]} to you:",
            *others,
            "",
            f"Your private goal (nobody else knows it): {slot['goal']}",
        ]
        if secrets:
            lines.append("Your secret (keep it to yourself): " + " ".join(secrets))
        lines += [
            "",
            "Each turn, write what you say, in character and briefly. You may also use these tags:",
            "- a non-verbal sign: <nonverbal>smiles</nonverbal>",
            "- a physical action: <act>hands over the keys</act>",
            "- leave the conversation for good: <leave/>",
            "- stay silent this turn: <pass/>",
        ]
        if self.fields:
            schema = "; ".join(f"{k}: {f.describe()}" for k, f in self.fields.items())
            example = {k: (f.enum[0] if f.enum else f.min) for k, f in self.fields.items()}
            lines += [
                f"- propose an agreement with every field filled in ({schema}): "
                f"<propose>{json.dumps(example)}</propose>",
                "- accept the proposal on the table: <accept/>",
                "An agreement forms when everyone else still present has accepted a proposal; the last one formed "
                "counts.",
            ]
        lines.append(
            f"Only your last tag counts. The conversation ends after {self.max_turns} turns in all, when fewer than "
            f"two people remain, or after {MAX_IDLE} silent turns in a row."
        )
        return "\n".join(lines)

    # -- parsing ----------------------------------------------------------------------------------

    def action_syntax(self, role: str) -> Syntax | None:
        can_accept = self.standing is not None and self.standing["by"] != role
        return catalogue.agreement_syntax(self.fields, can_accept) if self.fields else None

    def parse(self, role: str, text: str) -> Parsed:
        visible = clean(text, self.max_chars(role))
        content = SOCIAL_TAGS | ({"propose"} if self.fields else set())
        empty = EMPTY_TAGS | (AGREEMENT_TAGS if self.fields else set())
        tags = find_tags(visible, frozenset(content), frozenset(empty))
        rest = visible
        for tag in reversed(tags):
            rest = rest[: tag.start] + rest[tag.end :]
        speech = " ".join(rest.split())
        if not tags:
            return Parsed(Action("speak", speech) if speech else Action("idle"))
        tag = tags[-1]
        if tag.malformed:
            return Parsed(Action("speak", speech or visible.strip()), f"<{tag.name}> is never closed", True)
        if tag.name in ("nonverbal", "act"):
            payload = " ".join((tag.payload or "").split())
            if not payload:
                return Parsed(Action("speak", speech), f"<{tag.name}> is empty", True)
            return Parsed(Action(tag.name, payload))
        if tag.name == "leave":
            return Parsed(Action("leave", speech))
        if tag.name == "pass":
            return Parsed(Action("speak", speech) if speech else Action("idle"))
        if tag.name == "accept":
            if self.standing is None:
                return Parsed(Action("speak", speech), "there is no proposal to accept", True)
            if self.standing["by"] == role:
                return Parsed(Action("speak", speech), "you made the proposal on the table", True)
            return Parsed(Action("accept", self.standing["offer"]))
        try:
            return Parsed(Action("propose", self._offer(tag.payload or "")))
        except PayloadError as exc:
            return Parsed(Action("speak", speech), str(exc), True)

    def _offer(self, payload: str) -> dict[str, Any]:
        fields = self.fields
        raw = parse_fields(payload, tuple(fields), required=True)
        offer: dict[str, Any] = {}
        for name, spec in fields.items():
            value = raw[name]
            if not spec.is_int and isinstance(value, str):
                value = next((e for e in spec.enum or [] if e.lower() == value.strip().lower()), value)
            problem = spec.check(value)
            if problem:
                raise PayloadError(f"{name} {problem}")
            offer[name] = int(value) if spec.is_int else value  # type: ignore[arg-type]
        return offer

    # -- the game ---------------------------------------------------------------------------------

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        (role,) = parsed
        result = parsed[role]
        action = result.action
        assert action is not None
        visible = self._visible.strip()
        self.turn += 1
        events: list[str] = []
        if result.invalid:
            self.tell(role, f"[Referee] Your action was not recorded: {result.error}.")
        if action.tag == "idle":
            self.idle_run += 1
            self._deliver(role, f"[{role} stays silent.]")
        else:
            self.idle_run = 0
            self.own_texts[role].append(visible)
            self._deliver(role, f"{role}: {visible}")
        if action.tag == "propose":
            self.standing, self.accepted = {"by": role, "offer": action.value}, set()
        elif action.tag == "accept":
            self.accepted.add(role)
        elif action.tag == "leave":
            self.present.remove(role)
            self.transcript.append((None, f"[{role} left the conversation.]"))
            self._notify(self.transcript[-1][1], skip=role)
        self._maybe_agree(events)
        if self.turn >= self.max_turns:
            self.end_reason = "turn_limit"
        elif len(self.present) < 2:
            self.end_reason = "too_few_present"
        elif self.idle_run >= MAX_IDLE:
            self.end_reason = "idle"
        rewards: dict[str, float] = {}
        if self.done:
            events.append(f"end: {self.end_reason}")
            if not self.needs_judge:
                for r in self.roles:
                    self.points[r] = self._verified(r) or 0  # type: ignore[assignment]
                rewards = {r: self.outcome(r) for r in self.roles}
        else:
            self.next_seat = self._next_seat()
            nxt = self.roles[self.next_seat]
            self.tell(nxt, f"(Turn {self.turn + 1} of {self.max_turns}. Your turn.)")
        return StepResult(parsed, rewards, events)

    def step(self, actions: dict[str, str]) -> StepResult:
        # The others receive the author's text verbatim (after rules 1-2), tags included.
        self._visible = "".join(clean(text, self.max_chars(role)) for role, text in actions.items())
        return super().step(actions)

    def _deliver(self, role: str, text: str) -> None:
        self.transcript.append((self.turn, text))
        self._notify(text, skip=role)

    def _notify(self, text: str, skip: str = "") -> None:
        for other in self.present:
            if other != skip:
                self.tell(other, text)

    def _maybe_agree(self, events: list[str]) -> None:
        if self.standing is None:
            return
        proposer = self.standing["by"]
        others = [r for r in self.present if r != proposer]
        if others and all(r in self.accepted for r in others):
            self.agreement = dict(self.standing["offer"])
            self.agreement_turn = self.turn
            self.standing, self.accepted = None, set()
            text = f"[Referee] Agreement reached: {json.dumps(self.agreement)}"
            for r in self.present:
                self.tell(r, text)
            self.transcript.append((None, text))
            events.append(f"agreement {json.dumps(self.agreement)}")

    def _next_seat(self) -> int:
        n = len(self.roles)
        for k in range(1, n + 1):
            seat = (self.next_seat + k) % n
            if self.roles[seat] in self.present:
                return seat
        return self.next_seat

    # -- scoring ----------------------------------------------------------------------------------

    def _verified(self, role: str) -> float | None:
        return catalogue.goal_verified(self.scenario, self.label(role), self.agreement)

    def _leaked(self, role: str) -> bool | None:
        return catalogue.leaked(self.scenario, self.label(role), self.own_texts[role])

    @property
    def needs_judge(self) -> bool:
        return self.reward != "verifiable"

    def outcome(self, role: str) -> float:
        if not self.needs_judge:
            return float(self._verified(role) or 0.0)
        scores = self._scores(role)
        return outcome_of(scores) if scores is not None else 0.0

    def _scores(self, role: str) -> dict[str, float] | None:
        """The seven scores that define the reward: the judge's, and in hybrid mode the checks where they exist."""
        if self.verdict is None:
            return None
        scores = dict(self.verdict[self._agent_key(role)])
        if self.reward == "hybrid":
            verified, leaked = self._verified(role), self._leaked(role)
            if verified is not None:
                scores["goal"] = 10 * verified
            if leaked:
                scores["secret"] = -10
        return scores

    def _agent_key(self, role: str) -> str:
        return f"agent_{self.seat_index(role) + 1}"

    def judge_requests(self, fine_grained: bool = False) -> list[JudgeRequest]:
        if not self.done or self._judged:
            return []
        agents = tuple(self._agent_key(r) for r in self.roles)
        context = self._judge_context()
        out = [JudgeRequest("episode", JUDGE_INSTRUCTIONS, context, agents, DIMENSIONS)]
        if fine_grained:
            out.append(JudgeRequest("fine-grained", FINE_INSTRUCTIONS, context, agents, FINE_GRAINED))
        return out

    def _judge_context(self) -> str:
        assert self.kernel is not None
        data = self.kernel.data
        lines = [
            f"Scenario ({data['scenario']['category']}): {data['scenario']['text']}",
            f"Relationship: {RELATIONSHIPS[data['scenario']['relationship']]}.",
            "",
        ]
        for i, (role, p, slot) in enumerate(zip(self.roles, data["profiles"], data["scenario"]["slots"])):
            secrets = " ".join(s for s in (slot.get("secret"), p.get("secret")) if s) or "none"
            lines += [
                f"agent_{i + 1}: {role}, the {slot['label']}; {p['age']}, {p['pronoun']}, {p['occupation']}. "
                f"{p['bio']}",
                f"  goal: {slot['goal']}",
                f"  secret: {secrets}",
            ]
        lines += ["", "Transcript:"]
        lines += [text if turn is None else f"Turn {turn}. {text}" for turn, text in self.transcript]
        if self.agreement is None and self.fields:
            lines.append("(No agreement was reached.)")
        return "\n".join(lines)

    def judged(self, verdicts: list[Verdict | None]) -> dict[str, float]:
        self._judged = True
        self.verdict = verdicts[0] if verdicts else None
        self.fine = verdicts[1] if len(verdicts) > 1 else None
        self.judge_failed = bool(verdicts) and verdicts[0] is None
        if not self.needs_judge:
            return {}
        for r in self.roles:
            scores = self._scores(r)
            self.points[r] = overall_of(scores) if scores is not None else 0  # type: ignore[assignment]
        return {r: self.outcome(r) for r in self.roles}

    def result(self) -> Result:
        """The episode's result; ``info`` adds the agreement, per-seat checks and, once judged, the judge's scores
        (``judge``, ``fine_grained``) or ``judge_failed``."""
        result = super().result()
        info = result.info
        info["agreement"] = self.agreement
        info["goal_verified"] = {r: self._verified(r) for r in self.roles}
        info["secret_kept"] = {r: (None if self._leaked(r) is None else float(not self._leaked(r))) for r in self.roles}
        info["reward"] = self.reward
        if self._judged:
            info["judge_failed"] = self.judge_failed
            if self.verdict is not None:
                info["judge"] = {r: self.verdict[self._agent_key(r)] for r in self.roles}
            if self.fine is not None:
                info["fine_grained"] = {r: self.fine[self._agent_key(r)] for r in self.roles}
        return result

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"turns": float(self.turn), "left": float(len(self.roles) - len(self.present))}
        verified = [v for v in (self._verified(r) for r in self.roles) if v is not None]
        if verified:
            out["goal_verified"] = sum(verified) / len(verified)
            out["agreement"] = float(self.agreement is not None)
        leaks = [x for x in (self._leaked(r) for r in self.roles) if x is not None]
        if leaks:
            out["secret_kept"] = 1 - sum(leaks) / len(leaks)
        if self._judged:
            out["judge_failed"] = float(self.judge_failed)
            for verdict, dims, prefix in ((self.verdict, DIMENSIONS, "judge"), (self.fine, FINE_GRAINED, "fine")):
                if verdict is None:
                    continue
                for d in dims:
                    out[f"{prefix}/{d.name}"] = sum(v[d.name] for v in verdict.values()) / len(verdict)
                if prefix == "judge":
                    out["judge/overall"] = sum(overall_of(v) for v in verdict.values()) / len(verdict)
        return out

    def view(self, role: str) -> dict[str, Any]:
        label = self.label(role)
        agreement = (self.scenario.get("check") or {}).get("agreement") or {}
        return {
            **self._base_view(role),
            "scenario": self.scenario["id"],
            "label": label,
            "goal": self.scenario["slots"][self.seat_index(role)]["goal"],
            "fields": agreement.get("fields", {}),
            "conditions": agreement.get("conditions", {}).get(label, []),
            "standing": self.standing,
            "agreement": self.agreement,
            "present": list(self.present),
            "turn": self.turn + 1,
        }
