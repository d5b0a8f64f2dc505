"""The learner on a tiny random model: masks (D1), packing, log-prob agreement, gradient accumulation."""

from __future__ import annotations

import copy

import pytest
import torch

from repertory.agents.lm import LMAgent
from repertory.config import AlgoConfig, CriticConfig, LoraConfig
from repertory.envs import env_class
from repertory.generation import SamplingParams
from repertory.generation.hf import HFBackend
from repertory.models import load_tokenizer, tiny_model
from repertory.models.packing import PackedSequence, model_inputs, shared_prompt
from repertory.rollout import run_episodes, schedule
from repertory.train.batch import Batch, Experience, Sample, collect
from repertory.train.learner import Learner, _pair_sequences, micro_batches
from repertory.train.learner_state import load_learner, save_learner
from repertory.types import Action, Episode, Kernel, Result, RoleResult, Seat, Turn


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def episodes(tokenizer):
    """Two self-play IPD episodes of a tiny model with free (unconstrained) answers of up to 12 tokens."""
    backend = HFBackend(tiny_model(tokenizer, seed=3))
    agent = LMAgent(backend, "live", SamplingParams(1.0, 1.0, 12), seed=1, policy_id="live")
    specs = schedule("ipd", [agent, agent], 2, seed=0)
    for spec in specs:
        spec.trainable = [True, True]
    return run_episodes(specs)


def _learner(tokenizer, temperature=1.0, lora=True, critic=True, **algo) -> Learner:
    settings = AlgoConfig(**algo)
    loaded = tiny_model(tokenizer, seed=3)
    return Learner(loaded, settings, LoraConfig(enabled=lora, r=4), CriticConfig(), critic, temperature, seed=0)


def _d1_episode(p1_trainable: bool) -> Episode:
    kernel = Kernel("x/train/000", "x", "train", 0, 0, {})
    seats = [
        Seat("p0", "seller", "seller", "live", "live", True),
        Seat("p1", "buyer", "buyer", "snap", "snapshot@40" if not p1_trainable else "live", p1_trainable),
    ]
    turns = [
        Turn("p0", 0, 0, 0, [], "", prompt_ids=list(range(6)), response_ids=[6, 7, 2], logp_sample=[0.0] * 3),
        Turn("p1", 0, 1, 0, [], "", prompt_ids=list(range(9)), response_ids=[8, 9], logp_sample=[0.0] * 2),
        Turn("p0", 1, 2, 0, [], "", prompt_ids=[0, 1, 2, 3, 4, 5, 6, 7, 2, 8, 9, 10, 11], response_ids=[12, 13]),
    ]
    roles = {"seller": RoleResult(0, 0, 2, 0), "buyer": RoleResult(0, 0, 1, 0)}
    return Episode("e1", "x", kernel, 0, seats, turns, Result(roles, "done"), {})


@pytest.mark.parametrize("p1_trainable, expected", [(False, 5), (True, 7)])
def test_d1_loss_tokens_are_the_sampled_tokens_of_trainable_seats(p1_trainable, expected):
    batch = collect([_d1_episode(p1_trainable)])
    assert batch.n_tokens == expected
    p0_turn1 = [s for s in batch.samples if s.prompt_ids[:1] == [0] and len(s.prompt_ids) == 13][0]
    assert p0_turn1.n_tokens == 2  # p1's two tokens inside p0's prompt never count


def test_pad_equal_to_eos_keeps_the_sampled_eos_as_a_loss_token(tokenizer, episodes):
    learner = _learner(tokenizer, critic=False)
    assert learner.tokenizer.pad_token_id is not None
    batch = collect(episodes)
    eos_samples = [s for s in batch.samples if s.response_ids and s.response_ids[-1] in (0, 1, 2)]
    assert all(s.n_tokens == len(s.response_ids) for s in batch.samples)
    learner.score(batch)
    for s in eos_samples:
        index = batch.samples.index(s)
        assert batch.experience[index].logp_old.shape[0] == len(s.response_ids)


def test_truncated_turns_can_be_excluded():
    episode = _d1_episode(False)
    episode.turns[0].finish = "length"
    assert collect([episode], mask_truncated=True).n_tokens == 2
    assert collect([episode], mask_truncated=False).n_tokens == 5


def test_turns_of_a_seat_pack_into_one_sequence(episodes):
    packed, unpacked = collect(episodes, packing=True), collect(episodes, packing=False)
    assert len(unpacked.sequences) == len(unpacked.samples) == 40
    # a chain breaks only where re-rendering the chat did not reproduce the sampled tokens (e.g. a turn cut
    # by the token budget has no end-of-turn token); every span still sits exactly where its sample was
    assert len(packed.sequences) < len(unpacked.sequences) / 2
    for seq in packed.sequences:
        for index, start in seq.spans:
            sample = packed.samples[index]
            assert seq.input_ids[: start + len(sample.response_ids)] == sample.prompt_ids + sample.response_ids
    packed_tokens = sum(len(s.input_ids) for s in packed.sequences)
    unpacked_tokens = sum(len(s.input_ids) for s in unpacked.sequences)
    assert unpacked_tokens > 2 * packed_tokens


def _worst_logp_gap(batch) -> float:
    return max(
        float((batch.experience[i].logp_old - torch.tensor(s.logp_sample)).abs().max())
        for i, s in enumerate(batch.samples)
        if s.trained
    )


def test_learner_log_probs_match_the_sampler(tokenizer, episodes):
    learner = _learner(tokenizer)
    batch = collect(episodes)
    learner.score(batch)
    worst = _worst_logp_gap(batch)
    assert worst <= 1e-3
    # the reference (adapters off) equals the policy before any update: LoRA starts as the identity
    assert all(torch.allclose(x.logp_old, x.logp_ref, atol=1e-6) for x in batch.experience.values())


def test_a_wrong_temperature_breaks_log_prob_agreement(tokenizer, episodes):
    learner = _learner(tokenizer, temperature=0.7)
    batch = collect(episodes)
    learner.score(batch)
    worst = _worst_logp_gap(batch)
    assert worst > 1e-2


def _reusing_learner(tokenizer, critic=False):
    # micro-batches of a few sequences, so that the first is a spot check and the rest can reuse
    return _learner(tokenizer, critic=critic, micro_batch_tokens=64, mini_batches=1, lr=1e-2)


def test_an_exact_sampler_s_log_probs_are_the_old_policy_s_beyond_a_spot_check(tokenizer, episodes):
    batch = collect(episodes)
    learner = _reusing_learner(tokenizer)
    metrics = learner.score(batch, version=0)
    first = {i for seq in micro_batches(batch.sequences, learner.algo.micro_batch_tokens)[0] for i, _ in seq.spans}
    rest = [i for i, s in enumerate(batch.samples) if s.trained and i not in first]
    assert first and rest
    for i in rest:  # taken as recorded, not scored
        assert torch.equal(batch.experience[i].logp_old, torch.tensor(batch.samples[i].logp_sample))
    scored = sum(batch.samples[i].n_tokens for i in first)
    assert metrics["offpolicy/rescored_frac"] == pytest.approx(scored / batch.n_tokens)
    assert 0 < metrics["offpolicy/max_gap"] <= 1e-4 and batch.old_gap == 1e-4
    assert all(float(batch.experience[i].correction.min()) == 1.0 for i in rest)

    rescored = collect(episodes)
    full = _reusing_learner(tokenizer).score(rescored)  # no version: every sample scored
    assert full["offpolicy/rescored_frac"] == 1.0 and rescored.old_gap == 0.0
    for i in first:
        assert torch.equal(batch.experience[i].logp_old, rescored.experience[i].logp_old)
    for i in rest:
        assert torch.allclose(batch.experience[i].logp_old, rescored.experience[i].logp_old, rtol=0, atol=1e-4)


def test_an_update_from_reused_log_probs_equals_one_from_rescored(tokenizer, episodes):
    weights = []
    for version in (0, None):
        learner = _reusing_learner(tokenizer)
        batch = collect(episodes)
        learner.score(batch, version=version)
        batch.assign({i: torch.full((s.n_tokens,), 0.1 * (i % 7 - 3)) for i, s in enumerate(batch.samples)})
        learner.update(batch, seed_key=0)
        weights.append(torch.cat([p.detach().flatten() for p in learner.trainable_parameters()]))
    # the reused log-probs are the sampler's, within 1e-4 of a rescoring; through Adam's step (lr 1e-2) that is
    # about 1e-6 of weight, by the machine's rounding (1.1e-6 on one Zen 4 host), against steps of about 1e-2
    assert torch.allclose(weights[0], weights[1], rtol=0, atol=5e-6)


@pytest.mark.parametrize("case", ["stale", "critic", "gap"])
def test_the_policy_scores_every_sample_when_the_sampler_may_differ(tokenizer, episodes, case):
    batch = collect(episodes)
    learner = _reusing_learner(tokenizer, critic=case == "critic")
    if case == "gap":  # a sampler off by more than float noise in the spot check: the rest is not trusted
        first = micro_batches(batch.sequences, learner.algo.micro_batch_tokens)[0][0].spans[0][0]
        batch.samples[first].logp_sample = [x + 0.01 for x in batch.samples[first].logp_sample]
    metrics = learner.score(batch, version=1 if case == "stale" else 0)
    assert metrics["offpolicy/rescored_frac"] == 1.0 and batch.old_gap == 0.0
    assert metrics["offpolicy/max_gap"] == (
        pytest.approx(0.01, abs=1e-4) if case == "gap" else pytest.approx(0, abs=1e-4)
    )


def test_packing_gives_the_same_log_probs_values_and_update(tokenizer, episodes):
    results = {}
    for packing in (True, False):
        learner = _learner(tokenizer, mini_batches=1, lr=1e-2)
        batch = collect(episodes, packing=packing)
        learner.score(batch)
        advantages = {i: torch.full((s.n_tokens,), 0.1 * (i % 7 - 3)) for i, s in enumerate(batch.samples)}
        returns = {i: torch.full((s.n_tokens,), 0.05 * (i % 5)) for i, s in enumerate(batch.samples)}
        batch.assign(advantages, returns)
        stats = learner.update(batch, seed_key=0)
        weights = torch.cat([p.detach().flatten() for p in learner.trainable_parameters()])
        results[packing] = (batch, stats, weights)
    (b1, s1, w1), (b2, s2, w2) = results[True], results[False]
    for i in b1.experience:
        assert torch.allclose(b1.experience[i].logp_old, b2.experience[i].logp_old, atol=1e-5)
        assert torch.allclose(b1.experience[i].values, b2.experience[i].values, atol=1e-5)
    assert s1["loss/policy"] == pytest.approx(s2["loss/policy"], abs=1e-6)
    assert s1["loss/value"] == pytest.approx(s2["loss/value"], abs=1e-6)
    assert torch.allclose(w1, w2, atol=1e-5)


def test_pairs_that_extend_one_another_share_a_sequence_and_give_the_same_log_probs_and_gradient(tokenizer, episodes):
    # the logged turns of the round methods (MT-SFT, MT-KTO, ArCHer), shuffled as their batches are
    turns = [t for ep in episodes for seat in ep.seats for t in ep.trajectory(seat.seat_id) if t.response_ids]
    pairs = [(list(t.prompt_ids), list(t.response_ids)) for t in turns]
    pairs = [pairs[i] for i in torch.randperm(len(pairs), generator=torch.Generator().manual_seed(0)).tolist()]
    assert len(_pair_sequences(pairs, None, False)[1]) == len(pairs)
    assert len(_pair_sequences(pairs, None, True)[1]) < len(pairs) / 2
    weight = {i: 0.1 * (i % 5 - 2) for i in range(len(pairs))}
    results = {}
    for packing in (True, False):
        learner = _learner(tokenizer, critic=False, packing=packing)
        logps = learner.token_logps(pairs)
        learner.backward_on(pairs, lambda indices, lps: sum(weight[i] * lp.sum() for i, lp in zip(indices, lps)))
        results[packing] = logps, torch.cat([p.grad.flatten() for p in learner.trainable_parameters()])
    (packed, g1), (alone, g2) = results[True], results[False]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(packed, alone))
    assert [len(lp) for lp in packed] == [len(r) for _, r in pairs]
    assert torch.allclose(g1, g2, atol=1e-5) and g1.abs().sum() > 0


def test_a_shared_prompt_tree_sees_only_its_ancestors():
    tree = shared_prompt([1, 2, 3], [(0, [4, 5]), (1, [6]), (2, [])])
    assert tree.input_ids == [1, 2, 3, 4, 5, 6]
    assert tree.parents == [-1, 0, 1, 2, 3, 2]
    assert tree.spans == [(0, 3), (1, 5), (2, 6)]
    assert tree.predecessors(3, 2) == [2, 3] and tree.predecessors(5, 1) == [2]
    inputs = model_inputs([tree, PackedSequence([7, 8], [])], 0, torch.device("cpu"), torch.float32)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 0, 0, 0, 0]]
    sees = inputs["attention_mask"][:, 0] == 0
    assert sees[0, 5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # the second response never sees the first
    assert sees[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert sees[1, 1].nonzero().flatten().tolist() == [0, 1] and sees[1, 4].nonzero().flatten().tolist() == [4]


def test_candidates_sharing_one_prompt_give_the_same_log_probs_values_and_update(tokenizer):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 14, 6)]
    responses = [[torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 5, 1)] for _ in prompts]
    samples = [Sample(0, 0, p, r, [], True) for p, rs in zip(prompts, responses) for r in rs]
    trees = [
        shared_prompt(p, [(3 * j + c, r) for c, r in enumerate(rs)])
        for j, (p, rs) in enumerate(zip(prompts, responses))
    ]
    layouts = {
        "separate": [
            PackedSequence(s.prompt_ids + s.response_ids, [(i, len(s.prompt_ids))]) for i, s in enumerate(samples)
        ],
        # two trees and a chain in one padded micro-batch: padding and a chain beside trees must not leak
        "tree": trees[:2]
        + [
            PackedSequence(s.prompt_ids + s.response_ids, [(i, len(s.prompt_ids))])
            for i, s in enumerate(samples)
            if i >= 6
        ],
    }
    results = {}
    for name, sequences in layouts.items():
        learner = _learner(tokenizer, mini_batches=1, lr=1e-2)
        batch = Batch([], samples, sequences)
        learner.score(batch)
        advantages = {i: torch.full((s.n_tokens,), 0.2 * (i % 4 - 1.5)) for i, s in enumerate(samples)}
        returns = {i: torch.full((s.n_tokens,), 0.1 * (i % 3)) for i, s in enumerate(samples)}
        batch.assign(advantages, returns)
        stats = learner.update(batch, seed_key=0)
        weights = torch.cat([p.detach().flatten() for p in learner.trainable_parameters()])
        results[name] = (batch, stats, weights)
    (b1, s1, w1), (b2, s2, w2) = results["separate"], results["tree"]
    assert sorted(b2.experience) == list(range(9))
    for i in range(9):
        assert torch.allclose(b1.experience[i].logp_old, b2.experience[i].logp_old, atol=1e-5)
        assert torch.allclose(b1.experience[i].logp_ref, b2.experience[i].logp_ref, atol=1e-5)
        assert torch.allclose(b1.experience[i].values, b2.experience[i].values, atol=1e-5)
    assert s1["loss/policy"] == pytest.approx(s2["loss/policy"], abs=1e-6)
    assert s1["loss/value"] == pytest.approx(s2["loss/value"], abs=1e-6)
    assert torch.allclose(w1, w2, atol=1e-5)
    initial = torch.cat([p.detach().flatten() for p in _learner(tokenizer).trainable_parameters()])
    assert float((w1 - initial).abs().max()) > 1e-4  # the update did move the weights


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batches_reproduce_the_unsplit_gradient(tokenizer, episodes):
    grads = {}
    for budget in (1, 1 << 20):
        learner = _learner(tokenizer, mini_batches=1, micro_batch_tokens=budget, aggregation="seq-mean-token-mean")
        batch = collect(episodes, packing=False)
        learner.score(batch)
        advantages = {i: torch.linspace(-1, 1, s.n_tokens) for i, s in enumerate(batch.samples)}
        returns = {i: torch.full((s.n_tokens,), 0.3) for i, s in enumerate(batch.samples)}
        captured = []
        step = learner.optimizer.step

        def capture(*args, _step=step, _captured=captured, _learner=learner, **kwargs):
            _captured.append(torch.cat([p.grad.flatten() for p in _learner.trainable_parameters()]))
            return _step(*args, **kwargs)

        learner.optimizer.step = capture
        batch.assign(advantages, returns)
        learner.update(batch, seed_key=0)
        assert len(micro_batches(batch.sequences, learner.algo.micro_batch_tokens)) == (
            len(batch.sequences) if budget == 1 else 1
        )
        grads[budget] = captured[0]
    a, b = grads[1], grads[1 << 20]
    # float32 sums in a different order: compare the whole gradient, relative to its norm
    assert float((a - b).norm() / b.norm()) < 1e-5
    assert float(a.abs().sum()) > 0


def test_first_minibatch_ratio_is_one_and_no_token_is_clipped(tokenizer, episodes):
    learner = _learner(tokenizer, mini_batches=1, lr=1e-2)
    batch = collect(episodes)
    learner.score(batch)
    advantages = {i: torch.ones(s.n_tokens) for i, s in enumerate(batch.samples)}
    batch.assign(advantages, {i: torch.zeros(len(a)) for i, a in advantages.items()})
    stats = learner.update(batch, 0)
    assert stats["clip_frac"] == 0.0
    assert stats["kl"] == pytest.approx(0.0, abs=1e-6)


def test_an_update_needs_a_scored_batch_with_advantages(tokenizer, episodes):
    learner = _learner(tokenizer, critic=False)
    batch = collect(episodes)
    with pytest.raises(ValueError, match=r"were not scored: call Learner.score\(batch\) before update"):
        learner.update(batch, seed_key=0)
    learner.score(batch)
    with pytest.raises(ValueError, match=r"have no advantages: call batch.assign"):
        learner.update(batch, seed_key=0)
    scored = sorted(batch.experience)
    with pytest.raises(ValueError, match=f"sample {scored[0]} was scored but has no advantages"):
        batch.assign({i: torch.zeros(batch.samples[i].n_tokens) for i in scored[1:]})
    assert all(x.advantages is None for x in batch.experience.values())  # nothing assigned by a refused call


def test_a_step_that_cannot_move_the_policy_is_skipped(tokenizer, episodes):
    learner = _learner(tokenizer, critic=False, mini_batches=2, lr=1e-2, beta_kl=0.1)
    initial = [p.detach().clone() for p in learner.trainable_parameters()]
    batch = collect(episodes)
    learner.score(batch)
    zero = {i: torch.zeros(s.n_tokens) for i, s in enumerate(batch.samples)}
    batch.assign(zero)
    stats = learner.update(batch, seed_key=0)
    # zero advantages at pi = reference: the true gradient is 0, and no step (AdamW would amplify float noise)
    assert stats["skipped_frac"] == 1.0 and stats["loss/policy"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(initial, learner.trainable_parameters()))
    one = {i: torch.where(torch.arange(s.n_tokens) == 0, 1.0, 0.0) for i, s in enumerate(batch.samples)}
    batch.assign(one)
    stats = learner.update(batch, seed_key=1)
    assert stats["skipped_frac"] == 0.0
    moved = [p.detach().clone() for p in learner.trainable_parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(initial, moved))
    # away from the reference, zero advantages still leave the KL term's pull: that step is taken
    again = collect(episodes)
    learner.score(again)
    again.assign(zero)
    stats = learner.update(again, seed_key=2)
    assert stats["skipped_frac"] == 0.0 and stats["kl"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(moved, learner.trainable_parameters()))


def test_full_fine_tuning_keeps_a_frozen_reference(tokenizer, episodes):
    learner = _learner(tokenizer, lora=False, critic=False, mini_batches=1, lr=1e-2)
    batch = collect(episodes)
    learner.score(batch)
    batch.assign({i: torch.ones(s.n_tokens) for i, s in enumerate(batch.samples)})
    learner.update(batch, 0)
    after = collect(episodes)
    learner.score(after)
    before, now = batch.experience, after.experience
    moved = max(float((now[i].logp_old - before[i].logp_old).abs().max()) for i in before)
    assert moved > 1e-3
    assert all(torch.allclose(now[i].logp_ref, before[i].logp_ref, atol=1e-6) for i in before)


@pytest.mark.parametrize("share", [True, False])
def test_checkpoint_round_trip_restores_weights_and_optimizer(tokenizer, episodes, tmp_path, share):
    def make():
        loaded = tiny_model(tokenizer, seed=3)
        return Learner(
            loaded, AlgoConfig(mini_batches=1, lr=1e-2), LoraConfig(r=4), CriticConfig(share_backbone=share), True
        )

    learner = make()
    batch = collect(episodes)
    learner.score(batch)
    adv = {i: torch.ones(s.n_tokens) for i, s in enumerate(batch.samples)}
    batch.assign(adv, {i: torch.ones(len(v)) for i, v in adv.items()})
    learner.update(batch, 0)
    save_learner(learner, tmp_path / "ckpt")
    restored = make()
    load_learner(restored, tmp_path / "ckpt")
    for a, b in zip(learner.trainable_parameters(), restored.trainable_parameters()):
        assert torch.equal(a, b)
    # one more identical step from both keeps them identical (optimizer moments were restored)
    for each in (learner, restored):
        again = collect(episodes)
        each.score(again)
        again.assign(adv, {i: torch.ones(len(v)) for i, v in adv.items()})
        each.update(again, 1)
    for a, b in zip(learner.trainable_parameters(), restored.trainable_parameters()):
        assert torch.equal(a, b)
    assert copy.copy(share) == learner.shared_critic


@pytest.mark.parametrize("layout", ["chains", "tree"])
def test_attention_without_copied_heads_equals_the_copying_path(tokenizer, episodes, layout):
    """The learner's log-probs, values and update under repertory's grouped-query attention (3 query heads per
    key/value head, no copies) equal transformers' SDPA path, which copies the key/value heads."""
    if layout == "chains":
        batch_of = lambda: collect(episodes)  # noqa: E731
    else:
        prompt, responses = list(range(40, 60)), [list(range(70, 70 + n)) for n in (3, 5, 2)]
        samples = [Sample(0, 0, prompt, r, [], True) for r in responses]
        batch_of = lambda: Batch([], samples, [shared_prompt(prompt, list(enumerate(responses)))])  # noqa: E731
    results = {}
    for attention in ("repertory_gqa_sdpa", "sdpa"):
        loaded = tiny_model(tokenizer, hidden=96, heads=6, kv_heads=2, seed=3)
        loaded.model.set_attn_implementation(attention)
        algo = AlgoConfig(mini_batches=1, lr=1e-2)
        learner = Learner(loaded, algo, LoraConfig(r=4), CriticConfig(), needs_critic=True, seed=0)
        batch = batch_of()
        learner.score(batch)
        advantages = {i: torch.full((s.n_tokens,), 0.1 * (i % 7 - 3)) for i, s in enumerate(batch.samples)}
        returns = {i: torch.full((s.n_tokens,), 0.05 * (i % 5)) for i, s in enumerate(batch.samples)}
        batch.assign(advantages, returns)
        learner.update(batch, seed_key=0)
        results[attention] = batch, torch.cat([p.detach().flatten() for p in learner.trainable_parameters()])
    (ours, w1), (theirs, w2) = results["repertory_gqa_sdpa"], results["sdpa"]
    assert ours.experience and sorted(ours.experience) == sorted(theirs.experience)
    for i, mine in ours.experience.items():
        assert torch.allclose(mine.logp_old, theirs.experience[i].logp_old, atol=1e-5)
        assert torch.allclose(mine.values, theirs.experience[i].values, atol=1e-5)
    assert torch.allclose(w1, w2, atol=1e-5)


def test_credit_quality_correlates_each_turns_advantage_with_its_game_quality(episodes):
    episodes = copy.deepcopy(episodes)  # the tiny model's free text always parses as B: give the moves variety
    for k, turn in enumerate(t for ep in episodes for t in ep.turns):
        turn.action = Action("choose", "AB"[k % 3 == 0])
    batch = collect(episodes)
    quality = {ep.episode_id: env_class("ipd").turn_quality(ep) for ep in episodes}
    empty = torch.zeros(0)
    for ref in batch.trajectories:
        for index in ref.samples:
            q = quality[ref.episode.episode_id][(ref.seat_id, batch.samples[index].turn)]
            n = len(batch.samples[index].response_ids)
            # advantage = 2 q + 1 on every token: a perfect (affine) correlation
            batch.experience[index] = Experience(empty, empty, empty, advantages=torch.full((n,), 2 * q + 1.0))
    assert batch.credit_quality() == {"credit/quality_turns": 40.0, "credit/quality_corr": pytest.approx(1.0)}
    for experience in batch.experience.values():
        experience.advantages = -experience.advantages  # credit against quality
    assert batch.credit_quality()["credit/quality_corr"] == pytest.approx(-1.0)
    for experience in batch.experience.values():
        experience.advantages = torch.ones_like(experience.advantages)  # flat: no correlation is defined
    assert batch.credit_quality() == {"credit/quality_turns": 40.0}
