"""Training samples as the learner sees them: turns of trainable seats exactly as sampled, packed into
sequences where a seat's prompts extend each other, and single-turn batches of (prompt, response) pairs."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from repertory import algos
from repertory.envs import env_class
from repertory.envs.roles import RoleAdapters
from repertory.models.packing import PackedSequence, shared_prompt
from repertory.types import Episode


@dataclass
class Sample:
    """One turn of one trainable seat. ``trained`` is its loss mask (all response tokens or none)."""

    trajectory: int
    turn: int
    prompt_ids: list[int]
    response_ids: list[int]
    logp_sample: list[float]
    trained: bool
    policy_version: int = 0  # the version of the policy that sampled it
    adapter: str | None = None  # its seat's adapter under per-role adapters (model.adapters), else None
    grammar: str | None = None  # the grammar it was sampled under: its log-probs are that masked policy's

    @property
    def n_tokens(self) -> int:
        """Valid (loss-mask 1) tokens."""
        return len(self.response_ids) if self.trained else 0


@dataclass
class TrajectoryRef:
    """Where a trainable seat's samples came from."""

    episode_index: int
    seat_index: int
    episode: Episode
    seat_id: str
    samples: list[int]


@dataclass
class Experience:
    """Everything training attaches to one trained sample, one entry per response token: the learner's
    log-probs when the batch was scored (PPO's old policy), the reference policy's, the sampler-learner
    correction weights and, with a critic, its values (all from :meth:`Learner.score`); then the advantages
    and, for a critic, its targets (from the estimator or the round method, :meth:`Batch.assign`)."""

    logp_old: torch.Tensor
    logp_ref: torch.Tensor
    correction: torch.Tensor
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass
class Batch:
    """A rollout batch as the learner sees it; ``experience`` (by sample index) is filled by
    :meth:`Learner.score` and :meth:`assign`."""

    trajectories: list[TrajectoryRef]
    samples: list[Sample]
    sequences: list[PackedSequence]
    experience: dict[int, Experience] = field(default_factory=dict)
    old_gap: float = 0.0  # how far the old log-probs may be from the learner's own: the sampler's float noise

    @property
    def n_tokens(self) -> int:
        """Valid tokens of the batch (N_tok)."""
        return sum(s.n_tokens for s in self.samples)

    @property
    def has_returns(self) -> bool:
        """Whether critic targets were assigned (the value loss then trains the critic)."""
        return any(x.returns is not None for x in self.experience.values())

    def assign(self, advantages: dict[int, torch.Tensor], returns: dict[int, torch.Tensor] | None = None) -> None:
        """Attach each scored sample's per-token advantages (and critic targets); entries of samples without
        tokens to train are ignored, a scored sample without advantages is an error."""
        missing = [i for i in self.experience if i not in advantages]
        if missing:
            raise ValueError(f"sample {missing[0]} was scored but has no advantages")
        unscored = [i for i in advantages if i not in self.experience and self.samples[i].n_tokens]
        if unscored:
            raise ValueError(f"samples {unscored[:5]} have advantages but were not scored (Learner.score)")
        for index, experience in self.experience.items():
            experience.advantages = advantages[index]
            experience.returns = returns[index] if returns is not None else None

    def _credited(self) -> Iterator[tuple[TrajectoryRef, int, Experience]]:
        """(trajectory, turn index, experience) of each turn the estimator gave advantages."""
        for ref in self.trajectories:
            for index in ref.samples:
                experience = self.experience.get(index)
                if experience is not None and experience.advantages is not None:
                    yield ref, self.samples[index].turn, experience

    def credit_rows(self) -> list[dict[str, object]]:
        """Each trained turn's mean advantage and final critic target, by episode, seat and turn (``credit/``)."""
        return [
            {
                "episode_id": ref.episode.episode_id,
                "seat_id": ref.seat_id,
                "turn_index": turn,
                "advantage": float(experience.advantages.mean()),  # type: ignore[union-attr]
                "return": float(target[-1]) if (target := experience.returns) is not None and target.numel() else None,
            }
            for ref, turn, experience in self._credited()
        ]

    def credit_quality(self) -> dict[str, float]:
        """How the trained turns' advantages follow their local quality (``Env.turn_quality``, docs/algorithms.md
        4.8): ``credit/quality_corr``, the Pearson correlation over the turns whose game defines a quality, and
        ``credit/quality_turns``, their number; no correlation where either side is constant."""
        qualities: dict[str, dict[tuple[str, int], float]] = {}
        pairs = []
        for ref, turn, experience in self._credited():
            episode = ref.episode
            if episode.episode_id not in qualities:
                qualities[episode.episode_id] = env_class(episode.env).turn_quality(episode)
            quality = qualities[episode.episode_id].get((ref.seat_id, turn))
            if quality is not None:
                pairs.append((quality, float(experience.advantages.mean())))  # type: ignore[union-attr]
        if not pairs:
            return {}
        out = {"credit/quality_turns": float(len(pairs))}
        try:
            out["credit/quality_corr"] = statistics.correlation(*zip(*pairs))
        except statistics.StatisticsError:  # fewer than two turns, or a constant side
            pass
        return out

    def estimator_inputs(self) -> list[algos.TrajectoryInput]:
        """One :class:`algos.TrajectoryInput` per trajectory (values when the batch was scored with a critic)."""
        out = []
        for ref in self.trajectories:
            seat = ref.episode.seat(ref.seat_id)
            samples = [self.samples[i] for i in ref.samples]
            values = None
            if any(x.values is not None for x in self.experience.values()):
                values = [self._values(i) if s.trained else [] for i, s in zip(ref.samples, samples)]
            rounds = ref.episode.result.info.get("round_points")
            opponent = [s for s in ref.episode.seats if s.seat_id != ref.seat_id]
            turns = ref.episode.trajectory(ref.seat_id)
            round_fields = {}
            if rounds is not None and len(opponent) == 1:
                round_fields = {
                    "group_id": ref.episode.group_id,
                    "seat_id": ref.seat_id,
                    "turn_rounds": [t.game_round - 1 for t in turns],
                    "round_points": rounds[seat.name],
                    "opponent_seat_id": opponent[0].seat_id,
                    "opponent_round_points": rounds[opponent[0].name],
                }
            out.append(
                algos.TrajectoryInput(
                    env=ref.episode.env,
                    kernel_id=ref.episode.kernel_id,
                    iteration=ref.episode.iteration,
                    role=seat.role,
                    episode_index=ref.episode_index,
                    seat_index=ref.seat_index,
                    rewards=[t.reward for t in turns],
                    lengths=[s.n_tokens for s in samples],
                    values=values,
                    **round_fields,
                )
            )
        return out

    def _values(self, index: int) -> list[float]:
        values = self.experience[index].values
        assert values is not None
        return values.tolist()


def collect(
    episodes: list[Episode], packing: bool = True, mask_truncated: bool = False, roles: RoleAdapters | None = None
) -> Batch:
    """The training samples of every trainable seat, packed into sequences where prompts extend; with ``roles``
    (per-role adapters) each sample records its seat's adapter."""
    trajectories: list[TrajectoryRef] = []
    samples: list[Sample] = []
    sequences: list[PackedSequence] = []
    for e, episode in enumerate(episodes):
        for s, seat in enumerate(episode.seats):
            if not seat.trainable:
                continue
            ref = TrajectoryRef(e, s, episode, seat.seat_id, [])
            t = len(trajectories)
            adapter = roles.of_seat(env_class(episode.env), episode.kernel.data, s) if roles is not None else None
            for turn in episode.trajectory(seat.seat_id):
                trained = bool(turn.response_ids) and not (mask_truncated and turn.finish == "length")
                ref.samples.append(len(samples))
                samples.append(
                    Sample(
                        t,
                        turn.turn_index,
                        turn.prompt_ids,
                        turn.response_ids,
                        turn.logp_sample,
                        trained,
                        turn.policy_version,
                        adapter,
                        turn.grammar,
                    )
                )
            trajectories.append(ref)
            sequences.extend(_pack([(i, samples[i]) for i in ref.samples if samples[i].trained], packing))
    return Batch(trajectories, samples, sequences)


def _pack(samples: list[tuple[int, Sample]], packing: bool) -> list[PackedSequence]:
    out: list[PackedSequence] = []
    for index, sample in samples:
        full = list(sample.prompt_ids) + list(sample.response_ids)
        current = out[-1] if out and packing else None
        if current is not None and full[: len(current.input_ids)] == current.input_ids:
            current.input_ids = full
            current.spans.append((index, len(sample.prompt_ids)))
        else:
            out.append(PackedSequence(full, [(index, len(sample.prompt_ids))]))
    return out


def single_turn_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    advantages: list[float],
    grammars: list[str | None] | None = None,
) -> tuple[Batch, dict[int, torch.Tensor]]:
    """One learner sample per (prompt, response), its advantage on every token, scored under its grammar (the
    masked policy; ``grammars`` None: none has one). Consecutive samples with the same prompt (a state's
    candidates) share one tree sequence, so the prompt is encoded once for all of them."""
    grammars = grammars or [None] * len(prompts)
    samples = [
        Sample(i, 0, list(p), list(r), [], bool(r), grammar=g)
        for i, (p, r, g) in enumerate(zip(prompts, responses, grammars, strict=True))
    ]
    sequences = []
    for _, group in itertools.groupby((i for i, s in enumerate(samples) if s.trained), lambda i: samples[i].prompt_ids):
        members = list(group)
        sequences.append(shared_prompt(samples[members[0]].prompt_ids, [(i, samples[i].response_ids) for i in members]))
    adv = {
        i: torch.full((len(s.response_ids),), float(a))
        for i, (s, a) in enumerate(zip(samples, advantages))
        if s.trained
    }
    return Batch([], samples, sequences), adv
