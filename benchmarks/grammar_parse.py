"""Every game's turns under the grammar, sampled by a model: how many parse.
``python benchmarks/grammar_parse.py [--model tiny] [--turns 1000] [--tokens 128] [--games all]``.

Plays each game with one model in every seat under ``rollout.constrained: grammar`` until ``turns`` turns had an
action grammar, and prints one JSON line a game and a total: the grammar turns, the invalid ones (the referee
could not parse the action), those that did not end with the end-of-turn token, the games played and the seconds.
``--model tiny`` is a randomly initialised tiny model (its talk is noise, and it fills its budget: the worst case
for the bounds); any other name is loaded as ``repertory`` loads a policy. Job Interview's offer needs 192
tokens and a social proposal 96, so their budgets are at least that.
"""

import argparse
import json
import time

from repertory.agents.lm import LMAgent
from repertory.envs import env_class, env_names
from repertory.generation import SamplingParams
from repertory.generation.hf import HFBackend
from repertory.models import load_model, load_tokenizer, tiny_model
from repertory.rollout import run_episodes, schedule

MIN_TOKENS = {"job-interview": 192, "social": 96}  # the longest actions: a five-field offer, a full proposal


def parse_rate(backend: HFBackend, env: str, turns: int, tokens: int, seed: int) -> dict:
    """Play ``env`` in self-play under the grammar until ``turns`` grammar turns; count what did not parse."""
    params = SamplingParams(1.0, 1.0, max(tokens, MIN_TOKENS.get(env, 0)))
    agent = LMAgent(backend, "model", params, constrained="grammar", seed=seed, policy_id="model")
    seats = len(env_class(env).roles)
    counts, start, batch = {"grammar_turns": 0, "invalid": 0, "unended": 0, "games": 0}, time.perf_counter(), 0
    while counts["grammar_turns"] < turns:
        batch += 1
        for episode in run_episodes(schedule(env, [agent] * seats, 32, seed=seed * 1000 + batch)):
            counts["games"] += 1
            acting = [t for t in episode.turns if t.grammar is not None]
            counts["grammar_turns"] += len(acting)
            counts["invalid"] += sum(t.invalid for t in acting)
            counts["unended"] += sum(not t.response_ids or t.response_ids[-1] != backend.end_of_turn_id for t in acting)
    return {"env": env, **counts, "max_new_tokens": params.max_new_tokens, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--games", default="all", help="comma-separated game names, or all")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loaded = tiny_model(load_tokenizer(), seed=args.seed) if args.model == "tiny" else load_model(args.model)
    backend = HFBackend(loaded)
    every = [name for name in env_names() if not name.startswith("textarena")]
    games = every if args.games == "all" else args.games.split(",")
    total = {"grammar_turns": 0, "invalid": 0, "unended": 0, "games": 0, "seconds": 0.0}
    for env in games:
        line = parse_rate(backend, env, args.turns, args.tokens, args.seed)
        print(json.dumps(line), flush=True)
        for key in total:
            total[key] += line[key]
    print(json.dumps({"env": "all", "model": args.model, **total}))


if __name__ == "__main__":
    main()
