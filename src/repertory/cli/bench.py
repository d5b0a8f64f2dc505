"""``repertory bench``: ours against a naive baseline and the hardware limit, measured in one run."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from repertory.cli.common import MODEL_HELP, check_run_options, lm_options, out
from repertory.envs import env_class
from repertory.types import RepertoryError

bench_app = typer.Typer(help="Benchmarks: ours against a naive baseline and the hardware limit, in one run.")


@bench_app.command("rollout")
def bench_rollout(
    env: list[str] | None = typer.Option(None, "--env", "-e", help="Environments (default: trust-and-split, ipd)."),
    episodes: int = typer.Option(4, "--episodes", "-n", help="Self-play episodes per environment."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Token budget per turn."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    seed: int = typer.Option(0, "--seed", "-s", help="Master seed."),
    naive: bool = typer.Option(True, "--naive/--no-naive", help="Also run the naive per-turn generate() baseline."),
    backend: list[str] | None = typer.Option(
        None,
        "--backend",
        "-b",
        help="Generation engine(s), each on the same episodes: hf (default; paged cache), hf-padded (one left-padded "
        "cache), hf-kv-bf16 (pages in bfloat16), vllm.",
    ),
    precision: str = typer.Option(
        "float32", "--precision", help="The hf engine's linear layers: float32 (exact) or bfloat16 (CPU, faster)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """Batched multi-role rollout per engine against per-turn generate() calls, the matmul limit and the roofline
    (memory bandwidth and matmul throughput, pass by pass)."""
    from repertory.bench import BENCH_ENGINES, RolloutBenchConfig, rollout_benchmark
    from repertory.models import load_model
    from repertory.models.linear import PRECISIONS

    names = tuple(env or ("trust-and-split", "ipd"))
    for name in names:
        env_class(name)
    engines = tuple(dict.fromkeys(backend or ["hf"]))
    unknown = [kind for kind in engines if kind not in BENCH_ENGINES]
    if unknown:
        known = ", ".join(BENCH_ENGINES)
        raise RepertoryError(f"--backend: unknown generation backend {unknown[0]!r}; known: {known}")
    check_run_options("train", seed, episodes)
    lm_options(model, 1.0, 1.0, max_new_tokens, False, seed)
    if precision not in PRECISIONS:
        raise RepertoryError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    config = RolloutBenchConfig(names, episodes, max_new_tokens, seed, naive, backends=engines, precision=precision)
    result = rollout_benchmark(load_model(model), config)
    if as_json:
        print(json.dumps(result))
        return
    out.print(_rollout_table(result, names, naive))
    out.print(
        "engines: one batched generation per tick (hf: keyed prefix reuse; vllm: its prefix cache); naive: one "
        "generate() call per turn; limit: the matmul throughput as tokens/s (2 x parameters FLOPs per token); "
        "roofline: the hf run's forward passes, each at least its bytes read (weights, cached keys and values) over "
        "the memory bandwidth and its FLOPs over the matmul throughput; "
        "computed tokens = prompt tokens encoded (not cached) + generated"
    )
    out.print(
        f"matmul {result['limit_gflops']:.1f} GFLOP/s, memory {result['bandwidth_gbs']:.1f} GB/s on "
        f"{result['threads']} threads; peak RSS {result['peak_rss_mb']:.0f} MiB"
    )


def _rollout_table(result: dict, names: tuple[str, ...], naive: bool) -> Table:
    """Each engine, naive, the limit and the roofline: tokens/s and the ratios between them."""
    table = Table(title=f"rollout: {result['episodes']} self-play episodes of {', '.join(names)} ({result['model']})")
    columns = ("", "generated tok/s", "computed tok/s", "seconds", "start s", "cache hits", "vs naive", "vs limit")
    for column in (*columns, "vs roofline"):
        table.add_column(column, justify="right")
    for kind, numbers in result["engines"].items():
        table.add_row(
            kind,
            f"{numbers['tok_s']:.1f}",
            f"{numbers['computed_tok_s']:.1f}",
            f"{numbers['seconds']:.1f}",
            f"{numbers['start_seconds']:.1f}",
            f"{numbers['cache_hit_rate']:.1%}",
            f"{numbers['over_naive']:.2f}x" if naive else "-",
            f"{numbers['over_limit']:.1%}",
            f"{numbers['over_roofline']:.1%}" if numbers["over_roofline"] is not None else "-",
        )
    if naive:
        table.add_row(
            "naive",
            f"{result['naive_tok_s']:.1f}",
            f"{result['naive_computed_tok_s']:.1f}",
            f"{result['naive_seconds']:.1f}",
            "",
            "",
            "1.00x",
            f"{result['naive_tok_s'] / result['limit_tok_s']:.1%}",
            "-",
        )
    table.add_row("limit", f"{result['limit_tok_s']:.1f}", "", "", "", "", "", "100%", "")
    # every engine's roofline is the hf run's (vllm records no passes), none without hf
    roofline = next((n["roofline_tok_s"] for n in result["engines"].values() if n["roofline_tok_s"]), None)
    if roofline is not None:
        table.add_row("roofline", f"{roofline:.1f}", "", "", "", "", "", "", "100%")
    return table


def _print_step_table(title: str, result: dict, variants: tuple[str, ...]) -> None:
    """A training-step benchmark's variants and the limits: tokens computed, seconds, tok/s, and its share of the
    limit of its own precision (``KEY_limit_tok_s``, else float32's)."""
    table = Table(title=title)
    for column in ("", "tokens computed", "seconds", "tok/s", "vs limit"):
        table.add_column(column, justify="right")
    for key in variants:
        limit = result.get(f"{key}_limit_tok_s", result["limit_tok_s"])
        table.add_row(
            key,
            str(result[f"{key}_tokens"]),
            f"{result[f'{key}_seconds']:.2f}",
            f"{result[f'{key}_tok_s']:.0f}",
            f"{result[f'{key}_tok_s'] / limit:.1%}",
        )
    table.add_row("limit", "", "", f"{result['limit_tok_s']:.0f}", "100%")
    if "bfloat16_limit_tok_s" in result:
        table.add_row("limit (bfloat16)", "", "", f"{result['bfloat16_limit_tok_s']:.0f}", "100%")
    out.print(table)


@bench_app.command("train")
def bench_train(
    episodes: int = typer.Option(2, "--episodes", "-n", help="Self-play episodes (2 seats each) in the batch."),
    turns: int = typer.Option(8, "--turns", help="Turns per seat."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapters (the default recipe) or full fine-tuning."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """One optimisation step with packed turns (float32, and on a CPU with the frozen base's products in bfloat16)
    and unpacked turns, each against the matmul limit of its precision (6 x params x tokens)."""
    from repertory.bench import TrainBenchConfig, train_benchmark
    from repertory.models import load_model

    if episodes < 1 or turns < 1:
        raise RepertoryError("--episodes and --turns must be at least 1")
    result = train_benchmark(load_model(model), TrainBenchConfig(episodes=episodes, turns=turns, lora=lora))
    if as_json:
        print(json.dumps(result))
        return
    title = f"train step: {episodes} episodes x 2 seats x {turns} turns ({result['model']}, "
    variants = tuple(k for k in ("packed", "packed_bfloat16", "unpacked") if f"{k}_seconds" in result)
    _print_step_table(title + f"{'LoRA' if lora else 'full fine-tuning'})", result, variants)
    reduced = (
        f"the frozen base's products in bfloat16 make it {result['bfloat16_speedup']:.2f}x faster (matmul "
        f"{result['bfloat16_limit_gflops']:.1f} GFLOP/s in bfloat16); "
        if "bfloat16_speedup" in result
        else ""
    )
    out.print(
        f"packing makes the step {result['packed_speedup']:.2f}x faster on the same {result['trained_tokens']} "
        f"trained tokens; {reduced}matmul {result['limit_gflops']:.1f} GFLOP/s in float32 on {result['threads']} "
        f"threads; peak RSS {result['peak_rss_mb']:.0f} MiB"
    )
    out.print(
        f"scoring pass (float32, no critic): {result['score_seconds']:.2f} s with every sample scored, "
        f"{result['score_reused_seconds']:.2f} s with the exact sampler's log-probs taken as the old policy's "
        f"({result['score_reused_speedup']:.2f}x)"
    )


@bench_app.command("candidates")
def bench_candidates(
    states: int = typer.Option(2, "--states", "-n", help="Logged states in the step."),
    candidates: int = typer.Option(4, "--candidates", "-c", help="Sampled candidates per state."),
    prompt_tokens: int = typer.Option(640, "--prompt-tokens", help="Tokens of each state's prompt (its history)."),
    response_tokens: int = typer.Option(48, "--response-tokens", help="Tokens of each candidate."),
    model: str = typer.Option("smollm2", "--model", "-m", help=MODEL_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """Iterative GRPO's policy step with each state's prompt shared by its candidates, against one sequence
    per candidate and the float32 limit."""
    from repertory.bench import CandidatesBenchConfig, candidates_benchmark
    from repertory.models import load_model

    if min(states, candidates, prompt_tokens, response_tokens) < 1:
        raise RepertoryError("--states, --candidates, --prompt-tokens and --response-tokens must be at least 1")
    config = CandidatesBenchConfig(states, candidates, prompt_tokens, response_tokens)
    result = candidates_benchmark(load_model(model), config)
    if as_json:
        print(json.dumps(result))
        return
    title = (
        f"I-GRPO policy step: {states} states x {candidates} candidates, {prompt_tokens}-token prompts, "
        f"{response_tokens}-token candidates ({result['model']}, LoRA)"
    )
    _print_step_table(title, result, ("shared", "separate"))
    out.print(
        f"sharing each prompt makes the step {result['shared_speedup']:.2f}x faster on the same "
        f"{result['trained_tokens']} trained tokens (scoring with policy and reference, forward, backward, AdamW); "
        f"matmul {result['limit_gflops']:.1f} GFLOP/s on {result['threads']} threads; "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
    )


@bench_app.command("attention")
def bench_attention(
    rows: int = typer.Option(12, "--rows", "-n", help="Rows (sequences) decoding at once."),
    tokens: int = typer.Option(2400, "--tokens", help="Cached tokens per row."),
    repeats: int = typer.Option(20, "--repeats", help="Timed passes through the layers' caches (median)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a table."),
) -> None:
    """One layer's decode attention (SmolLM2's 9 query over 3 key/value heads of size 64, one query token per row)
    through SDPA and through repertory's kernel, against the memory bandwidth."""
    from repertory.bench import AttentionBenchConfig, attention_benchmark

    if min(rows, tokens, repeats) < 1:
        raise RepertoryError("--rows, --tokens and --repeats must be at least 1")
    result = attention_benchmark(AttentionBenchConfig(rows=rows, tokens=tokens, repeats=repeats))
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"decode attention: {rows} rows x {tokens} cached tokens, one layer's call")
    for column in ("", "ms per call", "keys+values GB/s", "vs bandwidth", "vs SDPA"):
        table.add_column(column, justify="right")
    labels = {"sdpa": "SDPA", "kernel": "kernel", "kernel_bfloat16": "kernel (bfloat16)"}
    for key, label in labels.items():
        if result[f"{key}_seconds"] is not None:
            speedup = result["sdpa_seconds"] / result[f"{key}_seconds"]
            table.add_row(
                label,
                f"{result[f'{key}_seconds'] * 1e3:.3f}",
                f"{result[f'{key}_gbs']:.1f}",
                f"{result[f'{key}_over_bandwidth']:.1%}",
                f"{speedup:.2f}x",
            )
    table.add_row("memory bandwidth", "", f"{result['bandwidth_gbs']:.1f}", "100%", "")
    out.print(table)
    kernel = (
        f"kernel and SDPA outputs differ by at most {result['max_abs_diff']:.1e}"
        if result["kernel_seconds"] is not None
        else "the kernel is unavailable (switched off or not built): SDPA only"
    )
    out.print(
        f"{kernel}; {result['layers']} layers' float32 caches ({result['layers'] * result['kv_bytes'] / 2**20:.0f} "
        f"MiB, beyond the last-level cache at the default size) called in turn; {result['threads']} threads; "
        "bfloat16: the kernel over a bfloat16 cache (half the bytes)"
    )
