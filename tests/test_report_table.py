"""`repertory report --table`: methods x environments from run directories (algorithms.md 5.7)."""

from __future__ import annotations

import json
import math

import pytest

from repertory.cli import main
from repertory.config import dump_config, load_config
from repertory.experiments import Exploitability, ExploitRun
from repertory.report import results_table, run_scores
from repertory.stats import (
    Decision,
    Paired,
    bootstrap_gain,
    decide,
    mean,
    paired_t,
    seeds_to_decide,
    t_critical,
    t_two_sided_p,
)
from repertory.types import RepertoryError


def _run(root, name, method, env, seed, curve, final, metric="discounted_return", extra=(), validation=None):
    """A run directory whose metrics hold the held-out ``metric`` (J) of pi_0..pi_{K-1} per iteration and pi_K as
    final/, and where given the ``validation`` scores of the trained pi_1..pi_K beside them."""
    run = root / name
    run.mkdir(parents=True)
    overrides = [f"rollout.env={env}", "rollout.opponent=bot", f"seed={seed}", *extra]
    overrides += [f"method.kind={method}"] if method != "omar" else []
    (run / "config.yaml").write_text(dump_config(load_config(None, overrides)))
    lines = [{"iteration": k, f"eval/{metric}": j} for k, j in enumerate(curve)]
    lines[-1][f"final/{metric}"] = final
    for k, score in enumerate(validation or [], start=1):
        line = lines[k] if k < len(lines) else lines[-1]
        line[f"eval/validation/{metric}" if k < len(lines) else f"final/validation/{metric}"] = score
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def _gamma_zero_run(root, name, seed, outcomes, final):
    """The default recipe's kind of run: omar at method.gamma 0 on IPD, so every held-out J is 0."""
    run = _run(root, name, "omar", "ipd", seed, outcomes, final, "outcome", ["method.gamma=0", "rollout.opponent=self"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line.update({k.replace("outcome", "discounted_return"): 0.0 for k in list(line) if k != "iteration"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


@pytest.fixture
def runs(tmp_path):
    # Q5: per-seed best 0.55, 0.57, 0.53 -> 0.55 ± .01 (the checkpoints the validation scores pick: 1, 2 and 3)
    return [
        _run(tmp_path, "igrpo-0", "igrpo", "craigslist", 0, [0.10, 0.55, 0.40], 0.45, validation=[0.5, 0.4, 0.5]),
        _run(tmp_path, "igrpo-1", "igrpo", "craigslist", 1, [0.12, 0.30, 0.57], 0.50, validation=[0.3, 0.6, 0.2]),
        _run(tmp_path, "igrpo-2", "igrpo", "craigslist", 2, [0.08, 0.20, 0.30], 0.53, validation=[0.1, 0.2, 0.3]),
        _run(tmp_path, "kto-0", "mt-kto", "craigslist", 0, [0.10, 0.20], 0.25, validation=[0.2, 0.1]),
        _run(tmp_path, "kto-u", "mt-kto", "ultimatum", 0, [0.00, 0.40], 0.30, validation=[0.1, 0.3]),
    ]


def test_run_scores_read_base_best_and_last(runs):
    scores = run_scores(runs[0])
    assert (scores.method, scores.env, scores.seed) == ("igrpo", "craigslist", 0)
    # validation 0.5, 0.4, 0.5 after 1, 2, 3 updates: the tie goes to the earlier checkpoint
    assert (scores.base, scores.best, scores.last, scores.best_iteration) == (0.10, 0.55, 0.45, 1)


def test_best_is_the_held_out_score_of_the_validation_best_checkpoint_not_the_held_out_best(tmp_path):
    # held-out after 1, 2, 3 updates: 0.9, 0.2, 0.4; validation prefers the second
    run = _run(tmp_path, "r", "igrpo", "craigslist", 0, [0.1, 0.9, 0.2], 0.4, validation=[0.3, 0.7, 0.5])
    scores = run_scores(run)
    assert (scores.best_iteration, scores.best, scores.last) == (2, 0.2, 0.4)
    assert results_table([run], "best").cells[("igrpo", "craigslist")] == (pytest.approx(0.2), 0.0, 1)
    final = _run(tmp_path, "f", "igrpo", "craigslist", 0, [0.1, 0.9, 0.2], 0.4, validation=[0.3, 0.7, 0.8])
    assert (run_scores(final).best_iteration, run_scores(final).best) == (3, 0.4)  # final/validation/ is pi_3's


def test_best_refuses_a_run_without_validation_scores_instead_of_selecting_on_held_out(tmp_path):
    old = _run(tmp_path, "old", "igrpo", "craigslist", 0, [0.1, 0.9, 0.2], 0.4)  # written before validation
    assert run_scores(old).best is None and run_scores(old).last == 0.4
    with pytest.raises(RepertoryError, match=r"old: --checkpoint best selects on validation evaluations"):
        results_table([old], "best")
    assert results_table([old]).cells[("igrpo", "craigslist")][0] == pytest.approx(0.4)  # last still reads
    partial = _run(tmp_path, "partial", "igrpo", "craigslist", 0, [0.1, 0.9, 0.2], 0.4, validation=[0.3])
    assert run_scores(partial).best is None  # pi_2 and pi_3 have no validation score: no choosing among a part
    once = _run(tmp_path, "once", "igrpo", "craigslist", 0, [0.1], 0.4)  # one trained evaluation: nothing to choose
    assert (run_scores(once).best, run_scores(once).best_iteration) == (0.4, 1)


def test_best_checkpoint_table_matches_q5(runs):
    table = results_table(runs, "best")
    assert (table.metric, table.why) == ("discounted_return", "")  # every run discounts: J, the paper's score
    mean, se, n = table.cells[("igrpo", "craigslist")]
    assert (mean, n) == (pytest.approx(0.55), 3) and se == pytest.approx(0.0115, abs=1e-4)
    assert table.text("igrpo", "craigslist") == "0.55 ± .01"
    assert table.cells[("base", "craigslist")][:2] == (
        pytest.approx(0.10),
        pytest.approx(0.02 / 3**0.5 * 1.0, abs=1e-9),
    )
    assert table.methods == ["base", "igrpo", "mt-kto"] and table.envs == ["craigslist", "ultimatum"]
    assert table.text("igrpo", "ultimatum") == "—"
    assert table.markdown().splitlines()[2] == "| base | 0.10 ± .01 | 0.00 (1 seed) |"  # one seed: no SE to show
    assert "igrpo,craigslist,0.550000,0.011547,3,best" in table.csv()


def test_last_checkpoint_table(runs):
    table = results_table(runs)
    assert table.checkpoint == "last"  # the protocol's default
    assert table.cells[("igrpo", "craigslist")][0] == pytest.approx((0.45 + 0.50 + 0.53) / 3)
    assert table.cells[("mt-kto", "ultimatum")] == (pytest.approx(0.30), 0.0, 1)


def test_rows_are_paired_by_seed_with_a_t_test_of_seeds_minus_one_df(runs):
    # igrpo - base per seed: 0.45 - 0.10, 0.50 - 0.12, 0.53 - 0.08 = 0.35, 0.38, 0.45: mean 0.3933, SE 0.02963,
    # t = 13.28 with 2 df: p = 1 - t / sqrt(2 + t^2) = 0.00563, CI mean ± 4.3027 SE; mt-kto has one seed, no pair
    table = results_table(runs)
    # mt-kto has one seed a game; over its two games: 0.25 - 0.10 and 0.30 - 0.00
    assert list(table.contrasts) == [("igrpo", "base", "craigslist"), ("mt-kto", "base", "pooled")]
    assert table.contrasts[("mt-kto", "base", "pooled")].mean == pytest.approx(0.225)
    c = table.contrasts[("igrpo", "base", "craigslist")]
    assert (c.mean, c.se, c.seeds) == (pytest.approx(0.393333, abs=1e-6), pytest.approx(0.029627, abs=1e-6), 3)
    assert (c.low, c.high, c.p) == (
        pytest.approx(0.265857, abs=1e-6),
        pytest.approx(0.520809, abs=1e-6),
        pytest.approx(0.005626, abs=1e-6),
    )
    assert "| igrpo − base | craigslist | +0.393 ± 0.030 | +0.266 to +0.521 | 0.006 | 3 |" in table.markdown()
    assert "igrpo,base,craigslist,0.393333,0.029627,0.265857,0.520809,0.00562582,3,last" in table.contrasts_csv()


def test_rows_are_also_paired_over_every_game_and_seed_together(tmp_path):
    # mt-kto - igrpo per (game, seed): craigslist -0.1, -0.3; ultimatum +0.1, -0.3 -> mean -0.15, SD 0.19149,
    # SE 0.095743, t = -1.5667 with 3 df (p = 0.2152, t_crit 3.1824: CI -0.15 ± 0.30469); each game has 2 seeds
    runs = [
        _run(tmp_path, f"{m}-{env}-{s}", m, env, s, [0.0], final)
        for m, env, finals in (
            ("igrpo", "craigslist", (0.5, 0.7)),
            ("mt-kto", "craigslist", (0.4, 0.4)),
            ("igrpo", "ultimatum", (0.2, 0.6)),
            ("mt-kto", "ultimatum", (0.3, 0.3)),
        )
        for s, final in enumerate(finals)
    ]
    table = results_table(runs)
    c = table.contrasts[("mt-kto", "igrpo", "pooled")]  # rows in name order: mt-kto is the later one
    assert (c.mean, c.se, c.seeds) == (pytest.approx(-0.15), pytest.approx(0.095743, abs=1e-6), 4)
    assert (c.low, c.high, c.p) == (
        pytest.approx(-0.45469, abs=1e-5),
        pytest.approx(0.15469, abs=1e-5),
        pytest.approx(0.2152, abs=1e-4),
    )
    assert ("mt-kto", "igrpo", "craigslist") in table.contrasts and ("mt-kto", "igrpo", "ultimatum") in table.contrasts
    assert "| mt-kto − igrpo | pooled | -0.150 ± 0.096 |" in table.markdown()


def test_each_arm_is_paired_with_its_own_start_where_the_arms_did_not_share_one(tmp_path):
    # igrpo starts at 0.10, 0.20 and ends at 0.50, 0.70; mt-kto (say, J at another discount) starts at 0.30, 0.40
    # and ends at 0.40, 0.60. The base row is each seed's mean start (0.20, 0.30); each arm's rise is its own:
    # igrpo +0.40, +0.50 and mt-kto +0.10, +0.20, not measured from the other arm's start.
    runs = [
        _run(tmp_path, f"{m}-{s}", m, "craigslist", s, [start], final)
        for m, starts, finals in (("igrpo", (0.1, 0.2), (0.5, 0.7)), ("mt-kto", (0.3, 0.4), (0.4, 0.6)))
        for s, start, final in zip((0, 1), starts, finals)
    ]
    table = results_table(runs)
    assert table.cells[("base", "craigslist")] == (pytest.approx(0.25), pytest.approx(0.05), 2)
    assert table.contrasts[("igrpo", "base", "craigslist")].mean == pytest.approx(0.45)
    assert table.contrasts[("mt-kto", "base", "craigslist")].mean == pytest.approx(0.15)
    assert table.contrasts[("mt-kto", "igrpo", "craigslist")].mean == pytest.approx(-0.10)


def test_table_errors(tmp_path, runs):
    with pytest.raises(RepertoryError, match="not a run directory"):
        results_table([tmp_path / "nothing"])
    _run(tmp_path, "again", "igrpo", "craigslist", 0, [0.1, 0.2], 0.3)
    with pytest.raises(RepertoryError, match="both igrpo on craigslist with seed 0"):
        results_table([runs[0], tmp_path / "again"])
    silent = _run(tmp_path, "silent", "igrpo", "casino", 0, [0.1], 0.2)
    (silent / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "outcome": 0.5}) + "\n")
    with pytest.raises(RepertoryError, match="no held-out evaluation of a trained checkpoint"):
        results_table([silent])
    with pytest.raises(RepertoryError, match="best or last"):
        results_table(runs, "median")


def test_report_table_command(runs, tmp_path, capsys):
    main(["report", "--table", *map(str, runs), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "0.49 ± .02" in printed and "mt-kto" in printed  # the last checkpoints: 0.45, 0.50, 0.53
    assert (tmp_path / "out" / "table.md").read_text().startswith("| method | craigslist | ultimatum |")
    assert (tmp_path / "out" / "table.csv").read_text().startswith("method,env,mean,se,seeds,checkpoint")
    assert "igrpo − base" in printed and (tmp_path / "out" / "contrasts.csv").read_text().startswith("method,minus,env")
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--table", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2
    assert "not a run directory" in capsys.readouterr().err


def test_the_table_of_outcomes_reads_the_outcome_lines(runs, tmp_path, capsys):
    for run, outcomes in zip(runs[:2], ([0.3, 0.6, 0.5], [0.2, 0.4, 0.45])):
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for line, value in zip(lines, outcomes):
            line["eval/outcome" if "final/discounted_return" not in line else "final/outcome"] = value
        lines[-1]["eval/outcome"] = outcomes[-1] - 0.1  # the last line's own pre-update evaluation
        for line in lines:  # validation outcomes that rank the checkpoints as the held-out ones do
            for when in ("eval", "final"):
                if f"{when}/outcome" in line:
                    line[f"{when}/validation/outcome"] = line[f"{when}/outcome"]
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    # seed 0: before 0.3, trained 0.6, 0.4 and 0.5 -> best 0.6; seed 1: before 0.2, trained 0.4, 0.35, 0.45
    table = results_table(runs[:2], "best", metric="outcome")
    assert table.cells[("igrpo", "craigslist")] == (pytest.approx(0.525), pytest.approx(0.075), 2)
    assert table.cells[("base", "craigslist")][0] == pytest.approx(0.25)
    assert table.csv().splitlines()[1] == "base,craigslist,0.250000,0.050000,2,best,outcome,heldout"
    main(["report", "--table", *map(str, runs[:2]), "--metric", "outcome", "--checkpoint", "best"])
    assert "held-out outcome, best checkpoint" in capsys.readouterr().out
    with pytest.raises(RepertoryError, match="logs no 'elo'; a table holds the held-out discounted_return or outcome"):
        results_table(runs, metric="elo")
    with pytest.raises(RepertoryError, match="no held-out evaluation of a trained checkpoint"):
        results_table(runs[2:3], metric="outcome")


def test_a_training_metric_is_tabled_as_each_runs_mean_over_its_iterations(tmp_path, capsys):
    # omar's quality correlation per iteration: seed 0 0.2, 0.4 (a NaN iteration left out) -> 0.3; seed 1 0.1, 0.3
    # -> 0.2. grpo's: seed 0 0.1; seed 1 0.0, 0.1 -> 0.05. Paired omar - grpo: 0.2, 0.15 -> 0.175 ± 0.025
    runs = []
    for arm, seed, values in [("omar", 0, [0.2, math.nan, 0.4]), ("omar", 1, [0.1, 0.3]), ("grpo", 0, [0.1]),
                              ("grpo", 1, [0.0, 0.1])]:  # fmt: skip
        run = _run(tmp_path, f"{arm}-{seed}", "omar", "craigslist", seed, [0.5], 0.6, extra=[f"method.estimator={arm}"])
        lines = [{"iteration": k, "credit/quality_corr": v} for k, v in enumerate(values)]
        lines[0] |= {"eval/discounted_return": 0.5}
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        runs.append(run)
    table = results_table(runs, metric="credit/quality_corr")
    assert table.cells[("omar", "craigslist")] == (pytest.approx(0.25), pytest.approx(0.05), 2)
    assert table.cells[("grpo", "craigslist")] == (pytest.approx(0.075), pytest.approx(0.025), 2)
    assert ("base", "craigslist") not in table.cells  # a training metric has no start evaluation
    paired = table.contrasts[("omar", "grpo", "craigslist")]
    assert (paired.mean, paired.se, paired.seeds) == (pytest.approx(0.175), pytest.approx(0.025), 2)
    assert table.title == "credit/quality_corr, mean over each run's iterations, mean ± SE over seeds"
    markdown = table.markdown()
    assert markdown.startswith("| method (credit/quality_corr, mean over iterations) | craigslist |")
    # what each mean is over, where the metric was not defined in every iteration
    assert markdown.endswith("iterations with a finite value, where fewer than all: omar-0 2 of 3\n")
    assert table.csv().splitlines()[1] == "grpo,craigslist,0.075000,0.025000,2,iterations,credit/quality_corr,train"
    main(["report", "--table", *map(str, runs), "--metric", "credit/quality_corr"])
    printed = capsys.readouterr().out
    assert "omar − grpo" in printed and "omar-0 2 of 3" in printed
    with pytest.raises(RepertoryError, match="--checkpoint best chooses among evaluated checkpoints"):
        results_table(runs, "best", metric="credit/quality_corr")
    with pytest.raises(RepertoryError, match="logs no 'kl'"):
        results_table(runs, metric="kl")
    with pytest.raises(RepertoryError, match="eval/outcome is an evaluation's score: --metric discounted_return or"):
        results_table(runs, metric="eval/outcome")
    (runs[2] / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "credit/quality_corr": math.nan}) + "\n")
    with pytest.raises(RepertoryError, match="grpo-0: metrics.jsonl logs no finite value of 'credit/quality_corr'"):
        results_table(runs, metric="credit/quality_corr")


def test_report_redraws_a_runs_figures(runs, capsys):
    lines = [json.dumps({"iteration": k, "outcome": 0.1 * k, "kl": 0.01}) for k in range(3)]
    (runs[0] / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    main(["report", str(runs[0])])
    assert (runs[0] / "report" / "outcome.png").is_file() and (runs[0] / "report" / "kl_entropy.png").is_file()
    assert not (runs[0] / "report" / "throughput.png").exists()  # only figures that have data
    assert "outcome.png" in capsys.readouterr().out.replace("\n", "")


J_IS_ZERO = (
    "J = gamma^(n-1) x outcome is then 0 for every game in which the agent took more than one turn, whatever it played"
)


def test_runs_at_gamma_zero_are_tabled_by_their_outcome_and_the_table_says_why(tmp_path, runs):
    zero = [
        _gamma_zero_run(tmp_path, "omar-ipd-0", 0, [0.80, 0.83], 0.86),
        _gamma_zero_run(tmp_path, "omar-ipd-1", 1, [0.78, 0.84], 0.82),
    ]
    table = results_table(zero)
    # last trained checkpoint per seed: 0.86 and 0.82 (final); base 0.80 and 0.78
    assert table.metric == "outcome" and table.cells[("omar", "ipd")] == (pytest.approx(0.84), pytest.approx(0.02), 2)
    assert table.cells[("base", "ipd")][0] == pytest.approx(0.79)
    assert table.why == f"the outcome, not J: method.gamma is 0 in 2 of the 2 runs, and {J_IS_ZERO}"
    assert table.csv().splitlines()[2] == "omar,ipd,0.840000,0.020000,2,last,outcome,heldout"
    explicit = results_table(zero, metric="discounted_return")  # asked for, J it is: every cell 0
    assert (explicit.metric, explicit.why, explicit.text("omar", "ipd")) == ("discounted_return", "", "0.00 ± .00")
    # one table, one score: a single gamma-0 run makes the others' cells outcomes too
    for run, outcome in zip(runs[:2], (0.6, 0.7)):
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        lines[0]["eval/outcome"], lines[-1]["final/outcome"] = 0.5, outcome
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    mixed = results_table([*runs[:2], zero[0]])
    assert mixed.metric == "outcome" and mixed.cells[("igrpo", "craigslist")][0] == pytest.approx(0.65)
    assert mixed.why == f"the outcome, not J: method.gamma is 0 in omar-ipd-0, and {J_IS_ZERO}"


def test_a_table_names_its_kernel_split_and_never_mixes_two(tmp_path, capsys):
    chosen = _run(tmp_path, "choose-0", "igrpo", "craigslist", 0, [0.1, 0.3], 0.4, extra=["eval.split=validation"])
    table = results_table([chosen])
    assert (table.split, table.title) == (
        "validation",
        "validation expected discounted return, last checkpoint, mean ± SE over seeds",
    )
    main(["report", "--table", str(chosen)])
    assert "validation expected discounted return, last checkpoint" in " ".join(capsys.readouterr().out.split())
    reported = _run(tmp_path, "report-0", "mt-kto", "craigslist", 0, [0.1, 0.2], 0.3)
    assert results_table([reported]).split == "heldout"
    with pytest.raises(
        RepertoryError, match=r"one table holds one kernel split, but its runs were evaluated on several"
    ):
        results_table([chosen, reported])


def test_report_table_at_gamma_zero_prints_the_outcome_and_why(tmp_path, capsys):
    zero = [_gamma_zero_run(tmp_path, "omar-ipd-0", 0, [0.80, 0.83], 0.86)]
    main(["report", "--table", str(zero[0])])
    printed = " ".join(capsys.readouterr().out.split())
    assert "held-out outcome, last checkpoint" in printed and "0.86 (1 seed)" in printed and "0.80 (1 seed)" in printed
    why = f"the outcome, not J: method.gamma is 0 in omar-ipd-0, and {J_IS_ZERO} (--metric discounted_return shows J)"
    assert why in printed
    main(["report", "--table", str(zero[0]), "--metric", "discounted_return"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "held-out expected discounted return, last checkpoint" in printed and "not J" not in printed


@pytest.mark.parametrize("t", [0.3, 1.0, 2.5, 4.302652729911275, 13.0])
def test_t_p_values_match_the_closed_forms_of_one_and_two_degrees_of_freedom(t):
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
    assert t_two_sided_p(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)


def test_t_critical_values_match_the_printed_tables():
    for df, printed in [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)]:
        assert t_critical(df) == pytest.approx(printed, abs=5e-4)
    assert t_critical(2, 0.90) == pytest.approx(2.920, abs=5e-4)


def test_paired_t_edges():
    with pytest.raises(RepertoryError, match="at least 2 seeds"):
        paired_t([0.1])
    assert paired_t([0.2, 0.2]) == Paired(0.2, 0.0, 0.2, 0.2, 0.0, 2)  # no spread: certain, whatever the df
    assert paired_t([0.0, 0.0, 0.0]).p == 1.0


def test_seeds_to_decide_make_the_interval_narrower_than_the_effect():
    # SD 0.01, effect 0.03: 2 t(n-1) 0.01 / sqrt(n) < 0.03 first at n = 5 (t(3) 3.182 / 2 = 1.59 >= 1.5; t(4)
    # 2.776 / sqrt(5) = 1.241 < 1.5); SD 0.05: 2 t(44) 0.05 / sqrt(45) = 0.03004, 2 t(45) 0.05 / sqrt(46) = 0.02970
    assert seeds_to_decide(0.01, 0.03) == 5
    assert seeds_to_decide(0.05, 0.03) == 46
    assert seeds_to_decide(0.0, 0.03) == 2
    assert seeds_to_decide(10.0, 0.001) is None  # beyond what anyone would run
    with pytest.raises(RepertoryError, match="must be positive"):
        seeds_to_decide(0.05, 0.0)


def test_a_contrast_says_what_it_decides_at_the_smallest_effect():
    def paired(low, high, se=0.02):
        return Paired((low + high) / 2, se, low, high, 0.5, 5)

    assert decide(paired(0.01, 0.09), 0.03) == Decision("above 0", True)
    assert decide(paired(-0.09, -0.01), 0.03) == Decision("below 0", True)
    assert decide(paired(0.04, 0.09), 0.03) == Decision("above +0.03", True)  # beyond the effect
    assert decide(paired(0.005, 0.02), 0.03) == Decision("above 0, below +0.03", True)  # real, but smaller
    assert decide(paired(-0.02, -0.005), 0.03) == Decision("below 0, above −0.03", True)
    assert decide(paired(-0.09, -0.04), 0.03) == Decision("below −0.03", True)
    assert decide(paired(-0.02, 0.02), 0.03) == Decision("within ±0.03", True)  # level at this scale
    # SE 0.02 over 5 seeds is an SD of 0.0447: 37 seeds narrow its CI below 0.03 (t(36) 2.028 x 0.0447 / 6.08)
    assert decide(paired(-0.08, 0.02), 0.03) == Decision("below +0.03", False, 37)  # refutes "ahead by 0.03"
    assert decide(paired(-0.02, 0.08), 0.03) == Decision("above −0.03", False, 37)
    assert decide(paired(-0.1, 0.1, se=0.05), 0.03) == Decision("open", False, 216)


def test_a_table_with_an_effect_decides_each_contrast(tmp_path, capsys):
    # omar - gae per seed +0.01, -0.01, +0.03: mean 0.01, SD 0.02, SE 0.011547, t 0.866 (p = 1 - t / sqrt(2 + t^2)
    # = 0.478), CI 0.01 ± 4.3027 SE = -0.0397 to +0.0597, which spans 0 and both ±0.03; 2 t(n-1) 0.02 / sqrt(n) <
    # 0.03 first at n = 10 (t(8) 2.306 / 3 = 0.769 >= 0.75; t(9) 2.262 / 3.162 = 0.715)
    runs = [
        _run(tmp_path, f"{m}-{s}", "omar", "craigslist", s, [0.0], final, extra=[f"arm={m}"])
        for m, finals in (("gae", (0.50, 0.52, 0.47)), ("omar", (0.51, 0.51, 0.50)))
        for s, final in enumerate(finals)
    ]
    table = results_table(runs, effect=0.03)
    assert table.decision_columns == ["at ±0.03", "seeds to decide"]
    assert "| omar − gae | craigslist | +0.010 ± 0.012 | -0.040 to +0.060 | 0.478 | 3 | open | about 10 |" in (
        table.markdown()
    )
    assert "| gae − base | craigslist | +0.497 ± 0.015 | +0.434 to +0.559 | < 0.001 | 3 | above +0.03 | — |" in (
        table.markdown()
    )
    assert table.contrasts_csv().splitlines()[0].endswith(",split,effect,decided,seeds_to_decide")
    assert ",heldout,0.03,open,10" in table.contrasts_csv()
    assert results_table(runs).contrasts_csv().splitlines()[-1].endswith(",heldout,,,")  # no effect: empty
    main(["report", "--table", *map(str, runs), "--effect", "0.03", "--out", str(tmp_path / "out")])
    assert "open" in capsys.readouterr().out
    assert (tmp_path / "out" / "contrasts.csv").read_text() == table.contrasts_csv()
    for bad in ("0", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            main(["report", "--table", *map(str, runs), "--effect", bad])
        assert "smallest effect of interest must be a positive number" in capsys.readouterr().err


def test_the_bootstrap_over_games_within_seeds():
    # every game gained: every resample's mean is above 0, so p is the smallest a run of 2,000 draws can give
    statistic, lower, p = bootstrap_gain([[0.5, 1.0], [0.25, 0.25, 0.5]], draws=2000)
    assert statistic == pytest.approx((0.75 + 1 / 3) / 2) and 0.25 <= lower <= statistic and p == 1 / 2001
    assert bootstrap_gain([[0.0, 0.0], [0.0]], draws=100)[2] == 1.0  # nothing gained: every draw at 0
    # one seed gains a lot on one game, the other loses a little on each: not significant
    assert bootstrap_gain([[1.0, 0.0, 0.0, 0.0], [-0.1, -0.1, -0.1, -0.1]])[2] > 0.05
    assert bootstrap_gain([[1.0, -1.0]], seed=3) == bootstrap_gain([[1.0, -1.0]], seed=3)  # seeded
    with pytest.raises(RepertoryError, match="at least one game in every seed"):
        bootstrap_gain([[0.1], []])


def test_exploitability_is_decided_by_the_games_not_a_z_cut_over_two_seeds():
    def run(seed, gains):
        return ExploitRun(seed, "", 0.0, mean(gains), 0.5, 0.5, gains)

    consistent = Exploitability("ipd", "v", 1, 8, [run(0, [0.1] * 7 + [0.0]), run(1, [0.2] * 8)], (0.5, 0.0))
    assert consistent.exploitable and consistent.to_json()["gain_p"] < 0.001
    # two seeds whose means (0.10 and 0.12) a 1.96 z cut calls significant, from 8 noisy games each
    noisy = Exploitability("ipd", "v", 1, 8, [run(0, [0.8, -0.6] * 4), run(1, [0.9, -0.66] * 4)], (0.5, 0.0))
    assert noisy.gain[0] > 1.96 * noisy.gain[1] and not noisy.exploitable


def test_a_table_names_the_runs_trained_in_another_precision(tmp_path, capsys):
    def trained(run, *precisions):
        lines = [{"from_iteration": k, "precision": p, "engine": "hf"} for k, p in enumerate(precisions)]
        (run / "sessions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return run

    runs = [_run(tmp_path, f"omar-{s}", "omar", "craigslist", s, [0.2], 0.5) for s in range(3)]
    assert results_table(runs).precisions == ""  # none recorded: nothing to compare
    for run in runs:
        trained(run, "bfloat16")
    assert results_table(runs).precisions == "" and "precision" not in results_table(runs).markdown()
    resumed = trained(
        _run(tmp_path, "gae-0", "omar", "craigslist", 0, [0.2], 0.4, extra=["arm=gae"]), "float32", "bfloat16"
    )
    old = _run(tmp_path, "gae-1", "omar", "craigslist", 1, [0.2], 0.4, extra=["arm=gae"])
    note = (
        "trained in more than one precision (sessions.jsonl): bfloat16: 3 runs; float32 then bfloat16: gae-0; "
        "not recorded: gae-1"
    )
    table = results_table([*runs, resumed, old])
    assert table.precisions == note and table.markdown().endswith(f"\n\n{note}\n")
    main(["report", "--table", *map(str, [*runs, resumed, old])])
    assert "float32 then bfloat16: gae-0" in capsys.readouterr().out
    trained(old, "bfloat16")
    with (old / "sessions.jsonl").open("a") as torn:
        torn.write('{"from_iteration": 1, "precision": "flo')  # a crash while a line was written: skipped
    assert results_table([*runs, old]).precisions == ""
