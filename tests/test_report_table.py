"""`repertory report --table`: methods x environments from run directories (algorithms.md 5.7)."""

from __future__ import annotations

import json

import pytest

from repertory.cli import main
from repertory.config import dump_config, load_config
from repertory.report import results_table, run_scores
from repertory.types import RepertoryError


def _run(root, name, method, env, seed, curve, final, metric="discounted_return", extra=()):
    """A run directory whose metrics hold the held-out ``metric`` (J) of pi_0..pi_{K-1} per iteration and pi_K as
    final/."""
    run = root / name
    run.mkdir(parents=True)
    overrides = [f"rollout.env={env}", "rollout.opponent=bot", f"seed={seed}", *extra]
    overrides += [f"method.kind={method}"] if method != "omar" else []
    (run / "config.yaml").write_text(dump_config(load_config(None, overrides)))
    lines = [{"iteration": k, f"eval/{metric}": j} for k, j in enumerate(curve)]
    lines[-1][f"final/{metric}"] = final
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
    # Q5: per-seed best 0.55, 0.57, 0.53 -> 0.55 ± .01
    return [
        _run(tmp_path, "igrpo-0", "igrpo", "craigslist", 0, [0.10, 0.55, 0.40], 0.45),
        _run(tmp_path, "igrpo-1", "igrpo", "craigslist", 1, [0.12, 0.30, 0.57], 0.50),
        _run(tmp_path, "igrpo-2", "igrpo", "craigslist", 2, [0.08, 0.20, 0.30], 0.53),
        _run(tmp_path, "kto-0", "mt-kto", "craigslist", 0, [0.10, 0.20], 0.25),
        _run(tmp_path, "kto-u", "mt-kto", "ultimatum", 0, [0.00, 0.40], 0.30),
    ]


def test_run_scores_read_base_best_and_last(runs):
    scores = run_scores(runs[0])
    assert (scores.method, scores.env, scores.seed) == ("igrpo", "craigslist", 0)
    assert (scores.base, scores.best, scores.last) == (0.10, 0.55, 0.45)


def test_best_checkpoint_table_matches_q5(runs):
    table = results_table(runs)
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
    table = results_table(runs, "last")
    assert table.cells[("igrpo", "craigslist")][0] == pytest.approx((0.45 + 0.50 + 0.53) / 3)
    assert table.cells[("mt-kto", "ultimatum")] == (pytest.approx(0.30), 0.0, 1)


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
    assert "0.55 ± .01" in printed and "mt-kto" in printed
    assert (tmp_path / "out" / "table.md").read_text().startswith("| method | craigslist | ultimatum |")
    assert (tmp_path / "out" / "table.csv").read_text().startswith("method,env,mean,se,seeds,checkpoint")
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
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    # seed 0: before 0.3, trained 0.6, 0.4 and 0.5 -> best 0.6; seed 1: before 0.2, trained 0.4, 0.35, 0.45
    table = results_table(runs[:2], metric="outcome")
    assert table.cells[("igrpo", "craigslist")] == (pytest.approx(0.525), pytest.approx(0.075), 2)
    assert table.cells[("base", "craigslist")][0] == pytest.approx(0.25)
    assert table.csv().splitlines()[1] == "base,craigslist,0.250000,0.050000,2,best,outcome"
    main(["report", "--table", *map(str, runs[:2]), "--metric", "outcome"])
    assert "held-out outcome, best checkpoint" in capsys.readouterr().out
    with pytest.raises(RepertoryError, match="metric must be one of discounted_return, outcome"):
        results_table(runs, metric="elo")
    with pytest.raises(RepertoryError, match="no held-out evaluation of a trained checkpoint"):
        results_table(runs[2:3], metric="outcome")


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
    # best trained checkpoint per seed: 0.86 (final) and 0.84 (iteration 1); base 0.80 and 0.78
    assert table.metric == "outcome" and table.cells[("omar", "ipd")] == (pytest.approx(0.85), pytest.approx(0.01), 2)
    assert table.cells[("base", "ipd")][0] == pytest.approx(0.79)
    assert table.why == f"the outcome, not J: method.gamma is 0 in 2 of the 2 runs, and {J_IS_ZERO}"
    assert table.csv().splitlines()[2] == "omar,ipd,0.850000,0.010000,2,best,outcome"
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


def test_report_table_at_gamma_zero_prints_the_outcome_and_why(tmp_path, capsys):
    zero = [_gamma_zero_run(tmp_path, "omar-ipd-0", 0, [0.80, 0.83], 0.86)]
    main(["report", "--table", str(zero[0])])
    printed = " ".join(capsys.readouterr().out.split())
    assert "held-out outcome, best checkpoint" in printed and "0.86 (1 seed)" in printed and "0.80 (1 seed)" in printed
    why = f"the outcome, not J: method.gamma is 0 in omar-ipd-0, and {J_IS_ZERO} (--metric discounted_return shows J)"
    assert why in printed
    main(["report", "--table", str(zero[0]), "--metric", "discounted_return"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "held-out expected discounted return, best checkpoint" in printed and "not J" not in printed
