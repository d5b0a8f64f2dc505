"""What a grammar's mask costs a decode step on the hf backend.
``python benchmarks/grammar_mask.py [--model smollm2] [--env craigslist] [--rows 16] [--tokens 96] [--repeats 3]``.

Samples ``rows`` rows of one ``env`` state under its turn grammar (``rollout.constrained: grammar``), ``repeats``
times, and prints one JSON object: the whole calls' seconds, the seconds spent in the masks (computing each
row's allowed tokens and advancing its grammar), their share, the forward passes and the mask's microseconds a
row-step. The same rows sampled free (no grammar) give the engine's own seconds a generated token, for scale.
"""

import argparse
import json
import time

from repertory.envs import load_kernels, make
from repertory.envs.grammar import turn_grammar
from repertory.generation import SamplingParams, make_backend
from repertory.generation.core import GenerationRequest
from repertory.generation.grammar import GrammarRow
from repertory.models import load_model
from repertory.models.chat import chat_prompt_ids
from repertory.types import Message


def timed_masks() -> dict[str, float]:
    """Wrap GrammarRow's two methods with a clock; the returned dict accumulates their seconds and calls."""
    spent = {"seconds": 0.0, "calls": 0}
    for name in ("allowed", "advance"):
        method = getattr(GrammarRow, name)

        def clocked(self, *args, _method=method):
            start = time.perf_counter()
            try:
                return _method(self, *args)
            finally:
                spent["seconds"] += time.perf_counter() - start
                spent["calls"] += _method.__name__ == "allowed"

        setattr(GrammarRow, name, clocked)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--env", default="craigslist")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    backend = make_backend("hf", load_model(args.model))
    env = make(args.env)
    env.reset(load_kernels(args.env, "train")[0], 0)
    role = env.acting_roles()[0]
    chat = [Message("system", env.system_prompt(role)), *env.observe(role)]
    prompt = chat_prompt_ids(backend.tokenizer, chat)
    grammar = turn_grammar(env.action_syntax(role), args.tokens, env.max_chars(role))
    params = SamplingParams(max_new_tokens=args.tokens)
    result: dict[str, float] = {}
    for mode, constraint in (("free", None), ("grammar", grammar)):
        backend.generate([GenerationRequest(prompt, 0, constraint)], params)  # warm: the masks' tokenizer, kernels
        spent = timed_masks() if constraint is not None else {"seconds": 0.0, "calls": 0}
        passes, generated, start = backend.stats.forward_passes, backend.stats.generated_tokens, time.perf_counter()
        for repeat in range(args.repeats):
            rows = [GenerationRequest(prompt, 1000 * repeat + i, constraint) for i in range(args.rows)]
            backend.generate(rows, params)
        seconds = time.perf_counter() - start
        result[f"{mode}_seconds"] = round(seconds, 3)
        result[f"{mode}_tokens"] = backend.stats.generated_tokens - generated
        result[f"{mode}_forward_passes"] = backend.stats.forward_passes - passes
        result[f"{mode}_ms_per_token"] = round(1000 * seconds / max(result[f"{mode}_tokens"], 1), 3)
        if constraint is not None:
            result["mask_seconds"] = round(spent["seconds"], 3)
            result["mask_share"] = round(spent["seconds"] / seconds, 4)
            result["mask_us_per_row_step"] = round(1e6 * spent["seconds"] / max(spent["calls"], 1), 1)
    print(json.dumps({"model": args.model, "env": args.env, "rows": args.rows, **result}))


if __name__ == "__main__":
    main()
