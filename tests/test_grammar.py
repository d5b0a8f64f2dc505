"""Grammar-constrained turns (``rollout.constrained: grammar``): every environment's action grammar, the masks a
sampler applies and a learner replays, and the commands that take ``--constrained grammar``."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import rows

from repertory.agents import Request, Response
from repertory.agents.lm import LMAgent
from repertory.cli.common import constrained_mode, with_optional_values
from repertory.config import load_config
from repertory.envs import env_class, env_names, load_kernels, make
from repertory.envs.grammar import (
    Syntax,
    TurnGrammar,
    choices_syntax,
    integer,
    integer_patterns,
    json_object,
    json_string,
    literal,
    sequence,
    turn_grammar,
)
from repertory.generation import SamplingParams
from repertory.generation.core import end_of_turn_id, stop_token_ids
from repertory.generation.grammar import grammar_masks
from repertory.generation.hf import HFBackend
from repertory.models import load_tokenizer, tiny_model
from repertory.rollout import run_episodes, schedule
from repertory.store import read_episodes, write_episodes
from repertory.train.batch import collect
from repertory.types import RepertoryError

GAMES = [name for name in env_names() if not name.startswith("textarena")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def masks(tokenizer):
    return grammar_masks(tokenizer, end_of_turn_id(tokenizer, stop_token_ids(tokenizer)))


def test_integer_patterns_match_exactly_the_range():
    for low in range(0, 60):
        for high in (low, low + 1, low + 9, low + 10, low + 99, 2250):
            pattern = re.compile("|".join(integer_patterns(low, high)))
            matched = [n for n in range(0, 2400) if pattern.fullmatch(str(n))]
            assert matched == list(range(low, high + 1)), (low, high)
            assert not pattern.fullmatch("0" + str(max(low, 1)))  # no leading zeros
    assert integer_patterns(1, 2250) == [
        "[1-9]", "[1-9][0-9]", "[1-9][0-9][0-9]", "1[0-9][0-9][0-9]", "2[0-1][0-9][0-9]", "22[0-4][0-9]", "2250"
    ]  # fmt: skip
    with pytest.raises(RepertoryError, match="low <= high"):
        integer(5, 4)
    signed = re.compile(integer(-12, 7).lark.strip("/"))
    assert [n for n in range(-40, 40) if signed.fullmatch(str(n))] == list(range(-12, 8))
    assert not signed.fullmatch("-0") and integer(-12, 7).max_chars == 3


def test_actions_under_a_grammar_are_tags():
    assert choices_syntax(["<a/>", "<b/>"]).opens_tag and sequence(literal("<a>"), integer(0, 9)).opens_tag
    assert not choices_syntax(["<a/>", "left"]).opens_tag and not integer(0, 9).opens_tag
    with pytest.raises(RepertoryError, match="an action under a grammar must be a tag, starting with '<'"):
        turn_grammar(choices_syntax(["<a/>", "left"]), 64, 100)


def test_syntax_builders_bound_their_length():
    offer = json_object([("price", integer(1, 2250)), ("where", json_string(["home", "office"]))])
    assert offer.max_chars == len('{"price": 2250, "where": "office"}')
    assert choices_syntax(["<a/>", "<bb/>", "<a/>"]) == Syntax('("<a/>" | "<bb/>")', 5, opens_tag=True)
    assert literal("café") == Syntax('"café"', 5)  # bytes: a token may hold part of a character


def test_a_turn_grammar_leaves_room_for_its_action_or_says_why():
    action = literal("<accept/>")
    grammar = turn_grammar(action, max_new_tokens=40, max_chars=100)
    assert "talk[max_tokens=30]" in grammar.lark and grammar.talk_bytes == 88
    assert TurnGrammar.loads(grammar.dumps()) == grammar
    assert turn_grammar(action, 10, 100).lark == 'start: action\naction: "<accept/>"\n'
    with pytest.raises(RepertoryError, match="raise max_new_tokens"):
        turn_grammar(action, 9, 100)


def _fuzz(masks, grammar: TurnGrammar, rng: torch.Generator, budget: int) -> list[int]:
    """A response drawn token by token, uniformly among the tokens the grammar allows (the random model)."""
    row, tokens = masks.start(grammar), []
    while not tokens or tokens[-1] != masks.end_of_turn_id:
        allowed = row.allowed(masks.vocab).nonzero().flatten()
        tokens.append(int(allowed[torch.randint(len(allowed), (1,), generator=rng)]))
        row.advance(tokens[-1])
        assert len(tokens) <= budget
    return tokens


class _GrammarFuzzer:
    """An agent that answers each request with uniformly random tokens under its turn's grammar."""

    name = policy_id = "fuzzer"

    def __init__(self, masks, tokenizer, budget: int, seed: int):
        self.masks, self.tokenizer, self.budget = masks, tokenizer, budget
        self.rng = torch.Generator().manual_seed(seed)
        self.turns = 0

    def act(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            text = "Nothing to add."
            if r.syntax is not None:
                grammar = turn_grammar(r.syntax, self.budget, r.max_chars or 2000)
                tokens = _fuzz(self.masks, grammar, self.rng, self.budget)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                self.turns += 1
            out.append(Response(text))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("env", GAMES)
def test_every_turn_under_its_grammar_parses(env, masks, tokenizer):
    """Hundreds of turns a game (thousands over the suite), each a uniformly random walk through its grammar:
    every one parses as a valid action, and the visible text fits what the game reads."""
    fuzzer = _GrammarFuzzer(masks, tokenizer, budget=160, seed=sum(map(ord, env)))
    seats = len(env_class(env).roles)
    turns, seed = [], 0
    while fuzzer.turns < 300 and seed < 40:
        seed += 1
        turns += [t for e in run_episodes(schedule(env, [fuzzer] * seats, 16, seed=seed)) for t in e.turns]
    assert fuzzer.turns >= 300 and [t.error for t in turns if t.invalid] == []


def test_masks_keep_talk_within_its_bytes(masks, tokenizer):
    grammar = turn_grammar(literal("<pass/>"), max_new_tokens=60, max_chars=40)
    rng = torch.Generator().manual_seed(0)
    for _ in range(30):
        text = tokenizer.decode(_fuzz(masks, grammar, rng, 60), skip_special_tokens=True)
        assert text.endswith("<pass/>") and text.count("<") == 1 and len(text) <= 40


def test_a_bad_grammar_or_token_is_one_clear_error(masks):
    with pytest.raises(RepertoryError, match="does not compile"):
        masks.start(TurnGrammar("start: /[a/\n", 0))
    row = masks.start(turn_grammar(literal("<pass/>"), 20, 100))
    with pytest.raises(RepertoryError, match="outside the grammar"):
        row.advance(masks.end_of_turn_id)  # the action must come first


@pytest.fixture(scope="module")
def grammar_episodes(tokenizer):
    """Craigslist and Werewolf self-play of a tiny random model under the grammar, trained seats marked."""
    backend = HFBackend(tiny_model(tokenizer, seed=3))
    agent = LMAgent(backend, "live", SamplingParams(1.0, 1.0, 48), constrained="grammar", seed=1, policy_id="live")
    specs = []
    for env, n in (("craigslist", 3), ("werewolf", 1)):
        specs += schedule(env, [agent] * len(env_class(env).roles), n, seed=0)
    for spec in specs:
        spec.trainable = [True] * len(spec.agents)
    return run_episodes(specs)


def test_sampled_turns_parse_and_record_their_grammar(grammar_episodes):
    turns = [t for e in grammar_episodes for t in e.turns]
    acting = [t for t in turns if t.grammar is not None]
    assert len(acting) > 20 and not any(t.invalid for t in turns)
    assert {t.action.tag for t in acting} & {"propose", "accept", "reject", "walkaway"}
    assert {t.action.tag for t in acting} & {"vote", "kill", "pass"}
    assert all(t.finish == "stop" for t in acting)


def test_the_learner_replays_the_grammar_and_scores_the_masked_policy(tokenizer, grammar_episodes):
    """Sampled log-probs under the grammar equal the learner's recomputation within 1e-4 (padded batches, kept
    prefixes across turns); a learner that ignores the grammar scores another policy."""
    from repertory.config import AlgoConfig, CriticConfig, LoraConfig
    from repertory.train.learner import Learner

    batch = collect(grammar_episodes)
    constrained = [i for i, s in enumerate(batch.samples) if s.trained and s.grammar is not None]

    def gaps(batch):
        learner = Learner(tiny_model(tokenizer, seed=3), AlgoConfig(), LoraConfig(r=4), CriticConfig(), False, 1.0, 0)
        learner.score(batch)
        sampled = [torch.tensor(batch.samples[i].logp_sample) for i in constrained]
        return [float((batch.experience[i].logp_old - s).abs().max()) for i, s in zip(constrained, sampled)]

    assert len(constrained) > 20 and max(gaps(batch)) <= 1e-4
    blind = collect(grammar_episodes)
    for sample in blind.samples:
        sample.grammar = None
    assert max(gaps(blind)) > 0.1


def test_a_response_that_could_not_be_sampled_under_its_grammar_is_named(masks, tokenizer, grammar_episodes):
    acting = [t for e in grammar_episodes for t in e.turns if t.grammar is not None]
    assert all(masks.misfit(t.grammar, list(t.response_ids)) is None for t in acting)
    grammar = turn_grammar(literal("<pass/>"), max_new_tokens=60, max_chars=40)  # talk of at most 30 bytes
    fits = tokenizer.encode("a few words <pass/>") + [masks.end_of_turn_id]
    assert masks.misfit(grammar.dumps(), fits) is None
    assert "stops before its grammar ends (no end-of-turn token)" in masks.misfit(grammar.dumps(), fits[:-1])
    eot, dumped = masks.end_of_turn_id, grammar.dumps()
    assert masks.misfit(dumped, [eot]).startswith(f"token {eot} at position 0 is outside its step's mask")
    assert masks.misfit(dumped, fits + [eot]) == f"token {eot} at position {len(fits)} follows the end-of-turn token"
    long = tokenizer.encode("word " * 8 + "<pass/>") + [eot]
    assert re.fullmatch(r"token \d+ at position [67] is outside its step's mask .*", masks.misfit(dumped, long))


def test_logs_whose_response_does_not_fit_their_grammar_are_refused(tmp_path, masks, tokenizer):
    from repertory.train.turns import check_grammars, read_logs

    grammar = turn_grammar(literal("<pass/>"), max_new_tokens=60, max_chars=40).dumps()
    row = {"episode_id": "e", "kernel_id": "k", "t": 0, "outcome": 1.0, "prompt_ids": [1], "grammar": grammar}
    good = tokenizer.encode("ok <pass/>") + [masks.end_of_turn_id]
    path = tmp_path / "logs.parquet"
    cut = row | {"t": 1, "response_ids": good[:-1]}
    pq.write_table(pa.Table.from_pylist([row | {"response_ids": good}, cut]), path)
    turns = read_logs(path, env_class("ipd"), tokenizer, 0.95)[0]
    assert [t.grammar for t in turns] == [grammar] * 2
    check_grammars(turns[:1], masks, str(path))
    with pytest.raises(RepertoryError, match="logs.parquet, row 1: the response does not fit its grammar: the res"):
        check_grammars(turns, masks, str(path))


def test_episodes_keep_their_grammar_on_disk(tmp_path, grammar_episodes):
    write_episodes(tmp_path / "e.parquet", grammar_episodes)
    back = read_episodes(tmp_path / "e.parquet")
    assert [t.grammar for e in back for t in e.turns] == [t.grammar for e in grammar_episodes for t in e.turns]


def test_a_row_under_a_grammar_samples_what_alone_it_would(tokenizer):
    """Rows under grammars batched with a free row: each gets the tokens and log-probs it gets alone."""
    backend = HFBackend(tiny_model(tokenizer, seed=4))
    env = make("deal-or-no-deal")
    env.reset(load_kernels("deal-or-no-deal", "train")[0], 0)
    grammar = turn_grammar(env.action_syntax(env.roles[0]), 80, env.max_chars(env.roles[0]))
    prompts = [tokenizer.encode("Make an offer."), tokenizer.encode("A longer prompt, to pad the other rows."), [5]]
    constraints = [grammar, grammar, None]
    params = SamplingParams(max_new_tokens=80)
    together = backend.generate(rows(prompts, [1, 2, 3], constraints=constraints), params)
    for i in range(3):
        alone = backend.generate(rows([prompts[i]], [i + 1], constraints=[constraints[i]]), params)[0]
        assert alone.response_ids == together[i].response_ids
        assert max(abs(a - b) for a, b in zip(alone.logp_sample, together[i].logp_sample)) < 1e-4
    for g in together[:2]:
        text = backend.decode(g.response_ids)
        assert g.finish == "stop" and not env.parse(env.roles[0], text).invalid


def test_the_constrained_option_takes_an_optional_mode():
    assert with_optional_values(["play", "ipd", "--constrained", "-n", "2"]) == [
        "play", "ipd", "--constrained", "choices", "-n", "2"
    ]  # fmt: skip
    assert with_optional_values(["play", "ipd", "--constrained", "grammar"])[-1] == "grammar"
    assert with_optional_values(["eval", "run", "--free"])[-2:] == ["--constrained", "off"]
    assert with_optional_values(["play", "ipd", "--constrained"])[-1] == "choices"
    assert [constrained_mode(m) for m in ("off", "choices", "grammar", None)] == [False, True, "grammar", None]
    with pytest.raises(RepertoryError, match="must be one of off, choices, grammar"):
        constrained_mode("tags")


def test_rollout_constrained_accepts_grammar_and_refuses_what_it_cannot_do():
    assert load_config(None, ["rollout.constrained=grammar"]).rollout.constrained == "grammar"
    assert load_config(None, ["rollout.constrained=true"]).rollout.constrained is True
    with pytest.raises(RepertoryError, match="rollout.constrained"):
        load_config(None, ["rollout.constrained=tags"])
    assert load_config("igrpo-craigslist", ["rollout.constrained=grammar"]).rollout.constrained == "grammar"


def test_play_under_the_grammar(tokenizer, tmp_path, capsys):
    from conftest import tiny_checkpoint

    from repertory.cli import main

    tiny_checkpoint(tmp_path / "ckpt", tokenizer, seed=5)
    args = ["play", "ultimatum", "-a", "model,bot", "--model", str(tmp_path / "ckpt"), "--json"]
    main([*args, "--constrained", "grammar", "--max-new-tokens", "48", "-n", "2"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["n_invalid"]["proposer"] == 0 and record["response_tokens"]["proposer"] > 10
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--constrained", "grammar", "--max-new-tokens", "8"])
    assert exit_info.value.code == 2 and "raise max_new_tokens" in capsys.readouterr().err
