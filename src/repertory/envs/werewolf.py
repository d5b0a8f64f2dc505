"""Werewolf (docs/environments.md 11): six seats, two wolves with a private channel, a seer and a witch.

Cycle c: the living wolves name a victim in seat order on their team channel; the seer inspects and
the witch saves, poisons or passes (these two act in the same step: neither sees the other); dawn
news; one public message per living seat in a rotating order; a simultaneous vote. Villagers win when
no wolf is left, wolves at parity; no winner after the vote of cycle 5 is a draw.
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from repertory.envs.base import Bot
from repertory.envs.parsing import clean
from repertory.envs.phased import DRAW, PhasedGame, acted
from repertory.types import Action, Parsed, StepResult, derive

NAMES = ("Ava", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kit", "Lena")
ROLES = ("villager", "villager", "werewolf", "werewolf", "seer", "witch")
VILLAGE, WOLVES = "village", "wolves"
MAX_CYCLES = 5
KILL, INSPECT, SAVE, POISON, VOTE = (frozenset({t}) for t in ("kill", "inspect", "save", "poison", "vote"))
WITCH_TAGS = frozenset({"save", "poison"})
NOTHING = "I have nothing to report yet."
_ACCUSATION = re.compile(r"\b([A-Za-z]+) is a werewolf\b", re.IGNORECASE)


def team(role_name: str) -> str:
    """The team of a game role: the wolves, or the village (villagers, seer, witch)."""
    return WOLVES if role_name == "werewolf" else VILLAGE


def _bot_rng(view: dict[str, Any]) -> random.Random:
    """A bot's randomness: derive(kernel_id, episode_seed, "bot", seat, cycle, phase)."""
    return random.Random(
        derive(view["kernel_id"], view["episode_seed"], "bot", view["seat"], view["round"], view["phase"])
    )


def _last_accusation(view: dict[str, Any]) -> tuple[str, str] | None:
    """(accuser, accused) of the latest "NAME is a werewolf" said in discussion about a living player."""
    living = {n.lower(): n for n in view["living"]}
    for _, speaker, text in reversed(view["discussion"]):
        for name in reversed(_ACCUSATION.findall(text)):
            if name.lower() in living:
                return speaker, living[name.lower()]
    return None


def random_legal(view: dict[str, Any]) -> str:
    """Every choice uniform over the legal ones (a vote over the living others, the witch over her potions
    and passing); a fixed line in discussion."""
    if view["phase"] == "discussion":
        return NOTHING
    rng = _bot_rng(view)
    if view["phase"] == "vote":
        return f"<vote>{rng.choice(view['targets'])}</vote>"
    return rng.choice(view["choices"])


def heuristic(view: dict[str, Any]) -> str:
    """docs/environments.md 11: wolves share a random victim and vote for the accuser; the seer inspects
    the uninspected and names a living wolf once found; the witch saves the first victim and never poisons;
    the village votes for the latest accused."""
    rng, phase = _bot_rng(view), view["phase"]
    if phase == "wolves":
        chosen = list(view["pack_votes"].values())
        target = chosen[0] if chosen and chosen[0] is not None else rng.choice(view["targets"])
        return f"Let us take {target}. <kill>{target}</kill>"
    if phase == "night":
        if view["role_name"] == "seer":
            fresh = [n for n in view["targets"] if n not in view["inspected"]]
            target = rng.choice(fresh or view["targets"])
            return f"<inspect>{target}</inspect>"
        if view["attacked"] is not None and view["save_left"]:
            return f"<save>{view['attacked']}</save>"
        return "<pass/>"
    if phase == "discussion":
        found = [n for n, wolf in view["inspected"].items() if wolf and n in view["living"]]
        return f"I am the seer. {found[0]} is a werewolf." if found else NOTHING
    accusation = _last_accusation(view)
    if view["team"] == WOLVES:
        accuser = accusation[0] if accusation else None
        legal = accuser if accuser in view["targets"] and accuser not in view["wolves"] else None
        target = legal or rng.choice([n for n in view["targets"] if n not in view["wolves"]])
    else:
        accused = accusation[1] if accusation else None
        target = accused if accused in view["targets"] else rng.choice(view["targets"])
    return f"I vote for {target}. <vote>{target}</vote>"


class Werewolf(PhasedGame):
    name = "werewolf"
    description = "Werewolf: six seats (2 villagers, 2 werewolves, a seer, a witch); team reward."
    roles = tuple(f"p{i}" for i in range(len(ROLES)))
    role_labels = ROLES  # the roles a kernel deals; seat_labels gives each seat's
    teams: ClassVar[tuple[str, ...]] = (VILLAGE, WOLVES)
    default_trained_role = "p0"
    scored_by_label = True
    bots: ClassVar[dict[str, Bot]] = {"random-legal": random_legal, "heuristic": heuristic}

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        names = rng.sample(list(NAMES), len(ROLES))
        roles = list(ROLES)
        rng.shuffle(roles)
        return {"names": names, "roles": roles}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        names, roles = data.get("names"), data.get("roles")
        problems = []
        if not isinstance(names, list) or len(names) != len(ROLES) or not all(isinstance(n, str) for n in names):
            problems.append(f"names must be a list of {len(ROLES)} names")
        elif len(set(names)) != len(names) or not set(names) <= set(NAMES):
            problems.append(f"names must be distinct names of {', '.join(NAMES)}")
        if not isinstance(roles, list) or sorted(map(str, roles)) != sorted(ROLES):
            problems.append(f"roles must be a permutation of {', '.join(ROLES)}")
        return problems

    @classmethod
    def seat_names(cls, data: dict[str, Any]) -> tuple[str, ...]:
        return tuple(data["names"])

    @classmethod
    def seat_labels(cls, data: dict[str, Any]) -> tuple[str, ...]:
        return tuple(data["roles"])

    @classmethod
    def seat_teams(cls, data: dict[str, Any]) -> tuple[str, ...]:
        return tuple(team(r) for r in data["roles"])

    def role_name(self, role: str) -> str:
        """The game role (villager, werewolf, seer, witch) of a seat."""
        return self.role_labels[self.seat_index(role)]

    # -- prompts -------------------------------------------------------------------------------------

    def system_prompt(self, role: str) -> str:
        kind = self.role_name(role)
        others = ", ".join(r for r in self.roles if r != role)
        lines = [
            f"You are {role}, playing Werewolf with {others}.",
            "There are six players: 2 villagers, 2 werewolves, 1 seer and 1 witch. Roles are secret and are "
            "not revealed when a player dies. The werewolves win when they are at least as many as the "
            f"other living players; everyone else wins when no werewolf is left. After day {MAX_CYCLES} the "
            "game is a draw, which counts as a loss for everyone.",
            "Every night the werewolves choose a victim, the seer inspects a player and the witch may use a "
            "potion. Every day each living player speaks once, then everyone votes at the same time; the "
            "player with the most votes is eliminated (a tie eliminates nobody). Dead players stop playing. "
            "A player who dies early earns less of the team's win.",
        ]
        if kind == "werewolf":
            partner = next(r for r in self.roles if r != role and self.role_name(r) == "werewolf")
            lines.append(
                f"Your secret role: werewolf. Your fellow werewolf is {partner}. At night the werewolves talk on "
                "their own channel, which nobody else sees, and each names the victim, for example "
                f"<kill>{self._example(role)}</kill>. The most named player is attacked."
            )
        elif kind == "seer":
            lines.append(
                "Your secret role: seer (you are on the village's side). Each night you inspect another living "
                f"player, for example <inspect>{self._example(role)}</inspect>, and learn privately whether they "
                "are a werewolf."
            )
        elif kind == "witch":
            lines.append(
                "Your secret role: witch (you are on the village's side). Each night you learn who the "
                f"werewolves attacked. You have one healing potion, for example <save>{self._example(role)}</save> "
                "(only the attacked player, yourself included), and one poison, for example "
                f"<poison>{self._example(role)}</poison> (another living player); at most one potion a night, "
                "or <pass/>."
            )
        else:
            lines.append("Your secret role: villager. You have no night action; find the werewolves by talking.")
        lines.append(
            f"In the vote write <vote>{self._example(role)}</vote> naming another living player, or <pass/> to "
            "abstain. Only your last action tag counts; a missing or invalid action does nothing. Night actions "
            "and votes are private; your messages in the day discussion are read by everyone, word for word."
        )
        return "\n".join(lines)

    def _example(self, role: str) -> str:
        return next(r for r in self.roles if r != role)

    # -- phases --------------------------------------------------------------------------------------

    def _open(self) -> None:
        self.save_left = self.poison_left = True
        self.inspected: dict[str, bool] = {}
        self.discussion: list[tuple[int, str, str]] = []
        self.votes: list[dict[str, str | None]] = []
        self.village_votes = [0, 0]  # [on a living wolf, cast]
        self._said: dict[str, str] = {}
        self._night()

    def _night(self) -> None:
        self.phase = "wolves"
        self.pack_votes: dict[str, str | None] = {}
        self.attacked: str | None = None
        self.wolf_queue = self.living(WOLVES)
        living = ", ".join(self.living())
        for wolf in self.wolf_queue:
            self.tell_private(wolf, f"Night {self.cycle}. Living players: {living}.")
        self._next_wolf()

    def _next_wolf(self) -> None:
        wolf = self.wolf_queue[len(self.pack_votes)]
        self.acting = [wolf]
        self.tell_private(
            wolf,
            "Your turn on the werewolves' channel: talk to your pack and name tonight's victim with "
            f"<kill>NAME</kill>, one of {', '.join(self._targets('kill', wolf))}.",
        )

    def _night_roles(self) -> dict[str, float]:
        """The seer and the witch act together: neither sees the other's move."""
        self.phase = "night"
        self.acting = [r for r in self.living() if self.role_name(r) in ("seer", "witch")]
        for role in self.acting:
            if self.role_name(role) == "seer":
                names = ", ".join(self._targets("inspect", role))
                self.tell_private(
                    role, f"Night {self.cycle}. Whom do you inspect? <inspect>NAME</inspect>, one of {names}."
                )
                continue
            attacked = f"attacked {self.attacked}" if self.attacked else "attacked no one"
            save = "unused" if self.save_left else "used"
            poison = "unused" if self.poison_left else "used"
            self.tell_private(
                role,
                f"Night {self.cycle}. The werewolves {attacked}. Healing potion: {save}. Poison: {poison}. "
                "Write <save>NAME</save>, <poison>NAME</poison> or <pass/>.",
            )
        return self._dawn(None, None) if not self.acting else {}

    def _dawn(self, saved: str | None, poisoned: str | None) -> dict[str, float]:
        dead = [r for r in self.roles if (r == self.attacked and r != saved) or r == poisoned]
        self.eliminate(dead)
        news = f"{' and '.join(dead)} died." if dead else "No one died."
        self.announce(f"Dawn of day {self.cycle}: {news}", also=dead)
        for role in dead:
            self.tell_private(role, "You are dead and take no further part.")
        finished = self._check_win()
        if finished is not None:
            return finished
        self.phase = "discussion"
        self.speakers = self.rotation((self.cycle - 1) % len(self.roles))
        self._next_speaker()
        return {}

    def _next_speaker(self) -> None:
        speaker = self.speakers[0]
        self.acting = [speaker]
        self.tell_private(speaker, f"Day {self.cycle} discussion: your turn to speak to everyone.")

    def _vote(self) -> None:
        self.phase = "vote"
        self.acting = self.living()
        for role in self.acting:
            names = ", ".join(self._targets("vote", role))
            self.tell_private(role, f"Day {self.cycle} vote: write <vote>NAME</vote> for one of {names}, or <pass/>.")

    def _check_win(self) -> dict[str, float] | None:
        if not self.living(WOLVES):
            self.announce("Game over: no werewolf is left; the village wins.", also=self.roles)
            return self.finish(VILLAGE, "village_win")
        if len(self.living(WOLVES)) >= len(self.living(VILLAGE)):
            self.announce("Game over: the werewolves are as many as the others; the werewolves win.", also=self.roles)
            return self.finish(WOLVES, "wolves_win")
        return None

    # -- actions -------------------------------------------------------------------------------------

    def _targets(self, tag: str, role: str) -> list[str]:
        """Who ``role`` may name with ``tag`` now."""
        others = [r for r in self.living() if r != role]
        if tag == "kill":
            return [r for r in others if self.team_of[r] != WOLVES]
        if tag == "save":
            return [self.attacked] if self.save_left and self.attacked is not None else []
        if tag == "poison":
            return others if self.poison_left else []
        return others

    def action_choices(self, role: str) -> list[str] | None:
        if self.phase == "discussion" or role not in self.acting_roles():
            return None
        tags = {"wolves": ("kill",), "vote": ("vote",)}.get(self.phase)
        if tags is None:
            tags = ("inspect",) if self.role_name(role) == "seer" else ("save", "poison")
        choices = [f"<{t}>{n}</{t}>" for t in tags for n in self._targets(t, role)]
        return choices + ["<pass/>"] * (self.phase == "vote" or self.role_name(role) == "witch")

    def parse(self, role: str, text: str) -> Parsed:
        if self.phase == "discussion":
            return Parsed(Action("message", clean(text)))
        if self.phase == "wolves":
            return self.parse_name(text, KILL, {"kill": self._targets("kill", role)}, "no <kill> tag")
        if self.phase == "vote":
            return self.parse_name(text, VOTE, {"vote": self._targets("vote", role)}, "no <vote> or <pass/> tag", True)
        if self.role_name(role) == "seer":
            return self.parse_name(text, INSPECT, {"inspect": self._targets("inspect", role)}, "no <inspect> tag")
        legal = {t: self._targets(t, role) for t in WITCH_TAGS}
        return self.parse_name(text, WITCH_TAGS, legal, "no <save>, <poison> or <pass/> tag", True)

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        rewards: dict[str, float] = {}
        events: list[str] = []
        if self.phase == "wolves":
            (wolf,) = parsed
            kill = acted(parsed[wolf])
            target = kill.value if kill.tag == "kill" else None
            self.pack_votes[wolf] = target
            self.tell_team(WOLVES, f"{wolf} (werewolves' channel): {self._said[wolf]}", exclude=wolf)
            events.append(f"night {self.cycle}: {wolf} names {target or 'no one'}")
            if len(self.pack_votes) < len(self.wolf_queue):
                self._next_wolf()
            else:
                rng = random.Random(derive(self.kernel.id, self.episode_seed, "kill", self.cycle))  # type: ignore[union-attr]
                self.attacked, _ = self.plurality(self.pack_votes, rng)
                self.tell_team(WOLVES, f"The pack attacks {self.attacked or 'no one'} tonight.")
                rewards = self._night_roles()
        elif self.phase == "night":
            saved = poisoned = None
            for role, p in parsed.items():
                act = acted(p)
                if act.tag == "inspect":
                    wolf = self.team_of[act.value] == WOLVES
                    self.inspected[act.value] = wolf
                    self.tell_private(role, f"{act.value} {'is' if wolf else 'is not'} a werewolf.")
                elif act.tag == "save":
                    saved, self.save_left = act.value, False
                elif act.tag == "poison":
                    poisoned, self.poison_left = act.value, False
            events.append(f"night {self.cycle}: attacked {self.attacked}, saved {saved}, poisoned {poisoned}")
            rewards = self._dawn(saved, poisoned)
        elif self.phase == "discussion":
            (speaker,) = parsed
            text = acted(parsed[speaker]).value
            self.discussion.append((self.cycle, speaker, text))
            for role in self.living():
                if role != speaker:
                    self.tell(role, f"{speaker}: {text}" if text.strip() else f"{speaker} said nothing.", "public")
            events.append(f"day {self.cycle}: {speaker} speaks")
            self.speakers.pop(0)
            if self.speakers:
                self._next_speaker()
            else:
                self._vote()
        else:
            rewards = self._count_votes(parsed, events)
        return StepResult(parsed, rewards, events)

    def _count_votes(self, parsed: dict[str, Parsed], events: list[str]) -> dict[str, float]:
        ballot = {r: (acted(p).value if acted(p).tag == "vote" else None) for r, p in parsed.items()}
        self.votes.append(ballot)
        for voter, target in ballot.items():
            if target is not None and self.team_of[voter] == VILLAGE:
                self.village_votes[0] += self.team_of[target] == WOLVES
                self.village_votes[1] += 1
        out, tally = self.plurality(ballot)
        cast = ", ".join(f"{v} → {t}" if t else f"{v} abstains" for v, t in ballot.items())
        if out is None:
            verdict = "It is a tie: nobody is eliminated." if tally else "No votes: nobody is eliminated."
        else:
            verdict = f"{out} is eliminated with {tally[out]} of {sum(tally.values())} votes."
        self.announce(f"Votes of day {self.cycle}: {cast}. {verdict}")
        events.append(f"day {self.cycle}: {verdict}")
        if out is not None:
            self.eliminate([out])
            self.tell_private(out, "You are dead and take no further part.")
        finished = self._check_win()
        if finished is not None:
            return finished
        if self.cycle == MAX_CYCLES:
            self.announce(f"Game over: no winner after day {MAX_CYCLES}; it is a draw.", also=self.roles)
            return self.finish(DRAW, "draw")
        self.cycle += 1
        self._night()
        return {}

    def step(self, actions: dict[str, str]) -> StepResult:
        # The wolves' night talk reaches the pack verbatim (after thinking and truncation), beside the kill.
        self._said = {role: clean(text) for role, text in actions.items()}
        return super().step(actions)

    # -- views and metrics ---------------------------------------------------------------------------

    def view(self, role: str) -> dict[str, Any]:
        kind = self.role_name(role)
        acting = role in self.acting_roles()
        wolf = kind == "werewolf"
        return {
            **self._base_view(role),
            "phase": self.phase if not self.done else "over",
            "name": role,
            "role_name": kind,
            "team": self.team_of[role],
            "alive": role in self.alive,
            "living": self.living(),
            "wolves": [r for r in self.roles if wolf and self.team_of[r] == WOLVES and r != role],
            "pack_votes": dict(self.pack_votes) if wolf and self.phase == "wolves" else {},
            "inspected": dict(self.inspected) if kind == "seer" else {},
            "attacked": self.attacked if kind == "witch" and self.phase == "night" else None,
            "save_left": self.save_left if kind == "witch" else False,
            "poison_left": self.poison_left if kind == "witch" else False,
            "targets": self._targets(self._tag_of(role), role) if acting else [],
            "choices": (self.action_choices(role) or []) if acting else [],
            "discussion": [list(d) for d in self.discussion],
            "votes": [dict(b) for b in self.votes],
        }

    def _tag_of(self, role: str) -> str:
        if self.phase == "wolves":
            return "kill"
        if self.phase == "night":
            return "inspect" if self.role_name(role) == "seer" else "poison"
        return "vote"

    def metrics(self) -> dict[str, float]:
        """Team results, the village's vote accuracy, the seer's share of wolves found, wolf survival."""
        wolves = [r for r in self.roles if self.team_of[r] == WOLVES]
        out = {
            "village_win": float(self.winner == VILLAGE),
            "wolves_win": float(self.winner == WOLVES),
            "draw": float(self.winner == DRAW),
            "cycles": float(self.cycle),
            "seer_found": sum(self.inspected.get(w, False) for w in wolves) / len(wolves),
            "wolf_survival": len(self.living(WOLVES)) / len(wolves),
        }
        if self.village_votes[1]:
            out["vote_accuracy"] = self.village_votes[0] / self.village_votes[1]
        return out
