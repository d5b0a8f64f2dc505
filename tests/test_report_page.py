"""``report/index.html``: what the page holds, its size bound, and the page itself in a real browser (Chromium)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from repertory.config import dump_config, load_config
from repertory.envs import env_class, env_names
from repertory.report import page
from repertory.report.metrics import behaviour_change, held_out_change, scale_title, split_by_scale
from repertory.report.page import episode_record, page_data, render_page, sample_evenly, write_page
from repertory.runs import RunDir
from repertory.store import read_credit, read_episodes, write_credit, write_episodes
from tests.conftest import play, run_cli

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextmanager
def chromium_tab(errors: list[str]) -> Iterator:
    """A tab of Debian's Chromium (through Playwright); console errors and page exceptions go to ``errors``."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.is_file(), "Debian's chromium is missing: `make test` installs it (apt-get install chromium)"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            yield tab
        finally:
            browser.close()


def _make_run(root: Path) -> Path:
    """A run directory with metrics, two iterations of episodes (Werewolf, then IPD with an invalid move) and the
    credit of two turns."""
    run = root / "run"
    (run / "episodes").mkdir(parents=True)
    (run / "config.yaml").write_text("rollout:\n  env: werewolf\nseed: 0\n")
    lines = [
        # kl is never finite: its figure has no data and is left out; loss/policy has a gap at iteration 1
        {"iteration": 0, "outcome": 0.4, "loss/policy": 0.2, "eval/outcome": 0.3, "eval/outcome_se": 0.05, "kl": None},
        {"iteration": 1, "outcome": 0.5, "loss/policy": float("nan"), "eval/outcome": 0.35, "eval/outcome_se": 0.04,
         "kl": float("inf"), "eval/fine/mutual_benefit_seeking": 6.5},
        {"iteration": 2, "outcome": 0.6, "loss/policy": 0.1, "final/outcome": 0.45, "final/outcome_se": 0.03,
         "kl": float("nan")},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    wolves = [dataclasses.replace(ep, iteration=0) for ep in play("werewolf", ["heuristic"] * 6, episodes=3)]
    script = root / "moves.txt"
    script.write_text("I will not choose </script><b>bold</b>\n<choose>A</choose>\n")
    ipd = [
        dataclasses.replace(ep, iteration=1)
        for ep in play("ipd", [f"script:{script}", "tit-for-tat"], episodes=2, seed=3, split="heldout")
    ]
    write_episodes(run / "episodes" / "iter-000000.parquet", wolves)
    write_episodes(run / "episodes" / "iter-000001.parquet", ipd)
    first, second = ipd[0].trajectory("p0")[:2]
    write_credit(
        run / "credit" / "iter-000001.parquet",
        [
            {"episode_id": ipd[0].episode_id, "seat_id": "p0", "turn_index": first.turn_index, "advantage": -0.75,
             "return": 0.25},
            {"episode_id": ipd[0].episode_id, "seat_id": "p0", "turn_index": second.turn_index, "advantage": 1.5,
             "return": None},
        ],
    )  # fmt: skip
    crossplay = {"env": "ipd", "agents": ["a", "b"], "M": {"a": {"a": 0.5, "b": 0.2}, "b": {"a": 0.8, "b": 0.5}}}
    (run / "crossplay-ipd.json").write_text(json.dumps(crossplay))
    return run


@pytest.fixture
def run_dir(tmp_path):
    return _make_run(tmp_path)


def _ipd_run(root: Path) -> RunDir:
    """A newcomer's first run: the default recipe (IPD, method.gamma 0, evaluated against always-cooperate),
    three iterations of two games each, and the final evaluation's four held-out games kept in ``heldout/``
    (beside a stale file of an earlier, longer-lived ending)."""
    run = RunDir(root / "omar-ipd")
    run.create(dump_config(load_config("default")))
    rollout = [(0.44, 44.0, 4.4, 0.3, 0.5), (0.47, 46.75, 4.675, 0.275, 0.5), (0.36, 35.75, 3.575, 0.0, 0.0)]
    lines = [
        {"iteration": k, "outcome": o, "env/collective_payoff": pay, "env/collective_payoff_per_round": per,
         "env/mutual_cooperation_rate": mutual, "env/cooperation_rate/Alice": alice, "env/draw": 0.0,
         "loss/policy": policy, "loss/value": value}
        for k, ((o, pay, per, mutual, alice), policy, value) in enumerate(
            zip(rollout, [0.0123, -0.00598, 0.0201], [0.41, 0.22, 0.15])
        )
    ]  # fmt: skip
    lines[0].update({"eval/outcome": 0.8, "eval/outcome_se": 0.021, "eval/discounted_return": 0.0,
                     "eval/discounted_return_se": 0.0, "eval/env/mutual_cooperation_rate": 0.75})  # fmt: skip
    lines[2].update({"final/outcome": 0.86, "final/outcome_se": 0.018, "final/discounted_return": 0.0,
                     "final/discounted_return_se": 0.0, "final/env/mutual_cooperation_rate": 0.65})  # fmt: skip
    run.metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for k in range(3):
        games = play("ipd", ["tit-for-tat", "random"], episodes=2, seed=k)
        write_episodes(run.episodes(k), [dataclasses.replace(ep, iteration=k) for ep in games])
    final = play("ipd", ["always-defect", "always-cooperate"], episodes=4, seed=7, split="heldout")
    write_episodes(run.heldout(3), [dataclasses.replace(ep, iteration=3) for ep in final])
    stale = play("ipd", ["random", "random"], episodes=2, seed=8, split="heldout")
    write_episodes(run.heldout(2), [dataclasses.replace(ep, episode_id=f"stale/{ep.episode_id}") for ep in stale])
    return run


@pytest.fixture
def ipd_run(tmp_path):
    return _ipd_run(tmp_path)


def test_each_seat_sees_exactly_its_messages_with_channels(run_dir):
    data, warnings = page_data(run_dir)
    assert warnings == [] and data["episodes_total"] == 5 and len(data["episodes"]) == 5
    wolf_game = data["episodes"][0]
    seats = {s["name"]: s["role"] for s in wolf_game["seats"]}
    seen = {name: {m["channel"] for t in wolf_game["turns"] if t["seat"] == name for m in t["seen"]} for name in seats}
    for name, role in seats.items():
        assert ("team" in seen[name]) == (role == "werewolf"), (name, role)
        assert "public" in seen[name]
    from repertory.store import read_episodes

    [original, *_] = read_episodes(run_dir / "episodes" / "iter-000000.parquet")
    assert [[m["content"] for m in t["seen"]] for t in wolf_game["turns"]] == [
        [m.content for m in t.observation] for t in original.turns
    ]


def test_invalid_moves_keep_the_referees_reason_and_credit_lands_on_its_turns(run_dir):
    data, _ = page_data(run_dir)
    game = next(ep for ep in data["episodes"] if ep["env"] == "ipd")
    alice = [t for t in game["turns"] if t["seat"] == "Alice"]
    assert alice[0]["invalid"] and alice[0]["text"].startswith("I will not choose </script>")
    assert alice[0]["error"] and "choose" in alice[0]["error"]
    assert not alice[1]["invalid"] and alice[1]["action"] == 'choose "A"'
    assert (alice[0]["advantage"], alice[0]["return"]) == (-0.75, 0.25)
    assert (alice[1]["advantage"], alice[1]["return"]) == (1.5, None)
    assert all(t["advantage"] is None for t in alice[2:])
    assert sum(t["advantage"] is not None for ep in data["episodes"] for t in ep["turns"]) == 2


def test_evaluations_and_curves_come_from_the_metrics_lines(run_dir):
    data, _ = page_data(run_dir)
    rows = data["evaluations"]["rows"]
    assert [(r["iteration"], r["outcome"], r["outcome_se"]) for r in rows] == [(0, 0.3, 0.05), (1, 0.35, 0.04),
                                                                             (3, 0.45, 0.03)]  # fmt: skip
    assert [f["id"] for f in data["figures"]] == ["outcome", "losses"]
    assert next(f for f in data["figures"] if f["id"] == "losses")["series"]["loss/policy"] == [[0, 0.2], [2, 0.1]]
    assert "fine/mutual_benefit_seeking" in data["evaluations"]["columns"]  # "_se" inside a word is no error bar
    assert "outcome_se" not in data["evaluations"]["columns"]
    outcome = next(f for f in data["figures"] if f["id"] == "outcome")
    assert outcome["series"]["outcome"] == [[0, 0.4], [1, 0.5], [2, 0.6]]
    assert outcome["series"]["eval/outcome"] == [[0, 0.3], [1, 0.35], [3, 0.45]]
    assert data["crossplay"][0]["M"]["b"]["a"] == 0.8
    headline = data["headline"]
    assert headline["opponent"] == "self"  # Werewolf, no seat fixed: it is measured against itself
    assert (headline["first_iteration"], headline["before"], headline["before_se"]) == (0, 0.3, 0.05)
    assert (headline["last_iteration"], headline["after"], headline["after_se"]) == (3, 0.45, 0.03)
    # 0.15 over sqrt(0.05^2 + 0.03^2) = 0.058310
    assert headline["rise"] == pytest.approx(0.15) and headline["standard_errors"] == pytest.approx(2.57248, abs=1e-5)
    html = render_page(data)
    assert "NaN" not in html.split('id="run-data">')[1].split("</script>")[0]  # JSON has no NaN: a gap


def test_the_headline_needs_two_evaluations_and_names_a_change_without_spread():
    assert held_out_change([{"iteration": 0, "eval/outcome": 0.5, "eval/outcome_se": 0.1}, {"iteration": 1}]) is None
    assert held_out_change([{"iteration": 0, "outcome": 0.5}]) is None
    # Every game the same outcome before and after (SE 0, or none logged): the rise has no size in SEs.
    change = held_out_change([{"iteration": 0, "eval/outcome": 0.6, "eval/outcome_se": 0.0},
                              {"iteration": 4, "final/outcome": 0.8}])  # fmt: skip
    assert (change.first_iteration, change.last_iteration, change.after_se) == (0, 5, 0.0)
    assert change.standard_errors is None
    assert change.describe() == "0.600 ± 0.000 -> 0.800 ± 0.000 (+0.200, no spread)"
    fall = held_out_change([{"iteration": 0, "eval/outcome": 0.436, "eval/outcome_se": 0.03},
                            {"iteration": 3, "final/outcome": 0.412, "final/outcome_se": 0.04}])  # fmt: skip
    assert fall.describe() == "0.436 ± 0.030 -> 0.412 ± 0.040 (-0.024, -0.5 SE)"


def test_the_headline_without_a_config_has_no_line_up(run_dir):
    (run_dir / "config.yaml").unlink()
    data, warnings = page_data(run_dir)
    assert warnings == [] and data["headline"]["opponent"] is None and data["config"] == ""
    (run_dir / "config.yaml").write_text("rollout: {env: nowhere}\n")
    data, warnings = page_data(run_dir)
    assert data["headline"]["opponent"] is None and data["headline"]["after"] == 0.45
    assert len(warnings) == 1 and "the game and the evaluation line-up are unknown" in warnings[0]
    assert "nowhere" in warnings[0] and data["behaviour"] is None


def test_transcripts_cannot_end_the_data_element_or_fill_the_template(run_dir):
    (run_dir / "config.yaml").write_text("seed: 0  # {{SCRIPT}} {{DATA}}\n")
    path, _ = write_page(run_dir)
    text = path.read_text()
    payload = text.split('<script type="application/json" id="run-data">')[1].split("</script>")[0]
    assert "I will not choose \\u003c/script>\\u003cb>bold\\u003c/b>" in payload
    assert json.loads(payload)["run"] == "run"
    assert json.loads(payload)["config"] == "seed: 0  # {{SCRIPT}} {{DATA}}\n"
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def test_sampling_spreads_evenly_and_the_size_bound_thins_the_sample(run_dir, monkeypatch):
    # the middle of each of `limit` equal stretches of the episodes in iteration order
    assert sample_evenly([list(range(10)), list(range(10, 20))], 4) == [2, 7, 12, 17]
    assert sample_evenly([[1, 2], [3]], 10) == [1, 2, 3]
    many = [[(i, 0), (i, 1)] for i in range(400)]  # more iterations than the limit: still spread to the last
    picked = sample_evenly(many, 300)
    assert len(picked) == 300 and picked[0][0] == 0 and picked[-1][0] == 399
    data, _ = page_data(run_dir, max_episodes=2)
    assert [ep["iteration"] for ep in data["episodes"]] == [0, 1]
    full = len(write_page(run_dir)[0].read_bytes())
    monkeypatch.setattr(page, "MAX_BYTES", full - 1)
    path, _ = write_page(run_dir)
    shown = json.loads(path.read_text().split('id="run-data">')[1].split("</script>")[0])["episodes"]
    # 5 episodes in one byte too many: keep int(5 x (full - 1) / full x 0.95) = 4, evenly spaced
    assert len(path.read_bytes()) < full and len(shown) == 4
    assert [ep["iteration"] for ep in shown] == [0, 0, 1, 1]


def test_long_messages_are_cut_in_the_page_only(run_dir):
    from repertory.store import read_episodes

    [ep, *_] = read_episodes(run_dir / "episodes" / "iter-000001.parquet")
    long = dataclasses.replace(ep.turns[0], text="x" * (page.MAX_MESSAGE_CHARS + 10))
    record = episode_record(dataclasses.replace(ep, turns=[long, *ep.turns[1:]]), {})
    assert record["turns"][0]["text"].endswith("[... 10 more characters in the episode file]")


def test_unreadable_files_are_named_and_the_rest_still_shows(run_dir, capsys):
    (run_dir / "episodes" / "iter-000002.parquet").write_bytes(b"not parquet")
    (run_dir / "credit" / "iter-000000.parquet").write_bytes(b"torn [bold]")
    (run_dir / "crossplay-torn.json").write_text('{"env": "ipd", "agents": ["a"')
    (run_dir / "crossplay-other.json").write_text('{"env": "ipd"}')
    code, out, err = run_cli(capsys, "report", str(run_dir))
    assert code == 0 and out.strip().splitlines()[-1] == str(run_dir / "report" / "index.html")
    assert "iter-000002.parquet: not a readable Parquet file" in err and "iter-000000.parquet: not a readable" in err
    assert "crossplay-torn.json: not a readable cross-play result" in err
    assert "crossplay-other.json: not a cross-play result (no agents and M matrix)" in err
    data = json.loads((run_dir / "report" / "index.html").read_text().split('id="run-data">')[1].split("</script>")[0])
    assert len(data["episodes"]) == 5 and len(data["warnings"]) == 4 and len(data["crossplay"]) == 1
    assert read_credit(run_dir / "credit" / "iter-000001.parquet")  # untouched


def test_report_rejects_a_negative_episode_count(run_dir, capsys):
    code, _, err = run_cli(capsys, "report", str(run_dir), "--max-episodes", "-1")
    assert code == 2
    assert err == "error: Invalid value for '--max-episodes': Input should be greater than or equal to 0\n"


def test_the_page_renders_filters_and_shows_a_seats_view_in_chromium(run_dir, tmp_path):
    path, _ = write_page(run_dir)
    data, _ = page_data(run_dir)
    wolf_means = [
        sum(ep["results"][s["name"]]["outcome"] for s in ep["seats"] if s["role"] == "werewolf") / 2
        for ep in data["episodes"]
        if ep["env"] == "werewolf"
    ]
    errors: list[str] = []
    with chromium_tab(errors) as tab:
        tab.goto(path.as_uri())
        assert tab.locator(".chart").count() == 2  # outcome and losses: the figures with data
        assert tab.inner_text("#headline") == (
            "Held-out outcome against self: 0.300 ± 0.050 (iteration 0) → 0.450 ± 0.030 (iteration 3), "
            "+0.150, 2.6 SE"
        )
        rows = tab.locator("#episode-table tbody tr")
        assert rows.count() == 5
        tab.select_option("#f-iteration", "1")
        assert rows.count() == 2 and tab.inner_text("#episode-count").startswith("2 of 5 episodes")
        tab.check("#f-invalid")
        assert rows.count() == 2  # both IPD games open with the scripted invalid move
        tab.click("#f-reset")
        tab.wait_for_function("document.querySelectorAll('#episode-table tbody tr').length === 5")
        tab.select_option("#f-split", "heldout")
        assert rows.count() == 2
        tab.select_option("#f-split", "")
        kernel = data["episodes"][0]["kernel"]
        tab.fill("#f-kernel", kernel)
        assert rows.count() == sum(ep["kernel"] == kernel for ep in data["episodes"]) == 1
        tab.fill("#f-kernel", "")
        tab.select_option("#f-role", "werewolf")
        assert rows.count() == 3
        tab.fill("#f-min", "0.5")  # the werewolves' mean outcome (discounted by when they were eliminated)
        assert rows.count() == sum(mean >= 0.5 for mean in wolf_means) == 2
        tab.fill("#f-min", "")
        tab.fill("#f-max", "0.1")
        assert rows.count() == sum(mean <= 0.1 for mean in wolf_means) == 1
        tab.click("#f-reset")
        tab.wait_for_function("document.querySelectorAll('#episode-table tbody tr').length === 5")
        rows.nth(0).click()
        wolf = tab.locator("#detail-panel tbody tr", has_text="werewolf").first.locator("td").first.inner_text()
        tab.click(f"#detail-panel .tabs button:has-text('{wolf} sees')")
        assert tab.locator("#detail-panel .transcript .badge.team").count() > 0
        tab.select_option("#f-iteration", "1")
        rows.nth(0).click()
        assert tab.locator("#detail-panel .badge.bad").count() >= 1
        assert tab.locator("#detail-panel .badge.credit", has_text="advantage -0.750").count() == 1
        assert "</script><b>bold</b>" in tab.inner_text("#detail-panel")  # shown as text, never as markup
        assert tab.locator("#detail-panel b").count() == 0
        assert tab.locator("#eval-tables table").count() == 2  # held-out and the cross-play matrix
        tab.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert errors == []
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_leads_with_the_change_in_the_games_key_behaviour(ipd_run, run_dir):
    data, warnings = page_data(ipd_run)
    assert warnings == [] and data["headline"]["opponent"] == "always-cooperate"
    assert data["behaviour"] == {
        "metric": "mutual_cooperation_rate",
        "label": "mutual cooperation",
        "first_iteration": 0,
        "last_iteration": 3,
        "before": 0.75,
        "after": 0.65,
        "change": pytest.approx(-0.10),
        "verdict": "it defects more",
    }
    assert page_data(run_dir)[0]["behaviour"] is None  # Werewolf names no one key behaviour


def test_a_key_behaviour_says_which_way_it_moved_and_needs_two_evaluations():
    ipd = env_class("ipd").key_metric
    rise = behaviour_change([{"iteration": 0, "eval/env/mutual_cooperation_rate": 0.2},
                             {"iteration": 4, "final/env/mutual_cooperation_rate": 0.9}], ipd)  # fmt: skip
    assert (rise.last_iteration, rise.change, rise.verdict) == (5, pytest.approx(0.7), "it cooperates more")
    assert rise.describe() == "mutual cooperation 0.200 -> 0.900 (+0.700): it cooperates more"  # train's last lines
    same = behaviour_change([{"iteration": 0, "eval/env/mutual_cooperation_rate": 0.5},
                             {"iteration": 1, "eval/env/mutual_cooperation_rate": 0.5}], ipd)  # fmt: skip
    assert same.verdict == "unchanged"
    assert behaviour_change([{"iteration": 0, "eval/env/mutual_cooperation_rate": 0.5}, {"iteration": 1}], ipd) is None


@pytest.mark.parametrize("name", [n for n in env_names() if env_class(n).key_metric is not None])
def test_every_declared_key_metric_is_one_the_game_reports(name):
    cls = env_class(name)
    [game] = play(name, [next(iter(cls.bots))] * len(cls.roles))
    assert cls.key_metric.name in game.metrics


def test_a_zero_discount_leaves_j_out_of_the_evaluations_and_says_why(ipd_run, run_dir):
    evaluations = page_data(ipd_run)[0]["evaluations"]
    assert evaluations["columns"] == ["outcome", "env/mutual_cooperation_rate"]
    assert [(row["iteration"], row["outcome"]) for row in evaluations["rows"]] == [(0, 0.8), (3, 0.86)]
    assert not any(k.startswith("discounted_return") for row in evaluations["rows"] for k in row)
    assert evaluations["note"] == (
        "discounted_return (J) is left out: this run's method.gamma is 0, and J = gamma^(n-1) x outcome is then 0 "
        "for every game in which the agent took more than one turn, whatever it played."
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines[0]["eval/discounted_return"] = 0.2  # the Werewolf run: omar's default gamma 0.95
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    evaluations = page_data(run_dir)[0]["evaluations"]
    assert evaluations["columns"][:2] == ["outcome", "discounted_return"]
    assert evaluations["note"] == (
        "discounted_return is J, the expected return discounted by method.gamma = 0.95 per own turn."
    )


def test_the_final_evaluations_games_are_kept_and_shown_as_held_out(ipd_run):
    kept = read_episodes(ipd_run.heldout(3))
    data, _ = page_data(ipd_run)
    final = [ep for ep in data["episodes"] if ep["source"] == "final"]
    assert [ep["id"] for ep in final] == [ep.episode_id for ep in kept] and len(kept) == 4
    assert {(ep["iteration"], ep["split"]) for ep in final} == {(3, "heldout")}
    assert [ep["results"]["Alice"]["points"] for ep in final] == [r.result.roles["Alice"].points for r in kept]
    assert not any(ep["id"].startswith("stale/") for ep in data["episodes"])  # not the evaluation the metrics end on
    assert [ep["source"] for ep in data["episodes"]].count("training") == 6 and data["episodes_total"] == 10
    # 4 places: the final games take up to half (2), the training games the rest, each evenly spread
    sample = page_data(ipd_run, max_episodes=4)[0]["episodes"]
    assert [(ep["source"], ep["iteration"]) for ep in sample] == [("training", 0), ("training", 2), ("final", 3),
                                                                    ("final", 3)]  # fmt: skip


def test_charts_never_share_an_axis_across_scales(ipd_run):
    series = {
        "env/collective_payoff": ([0, 1, 2], [44.0, 46.75, 35.75]),
        "env/collective_payoff_per_round": ([0, 1, 2], [4.4, 4.675, 3.575]),
        "env/cooperation_rate/Alice": ([0, 1, 2], [0.5, 0.5, 0.0]),
        "env/draw": ([0, 1, 2], [0.0, 0.0, 0.0]),
        "env/mutual_cooperation_rate": ([0, 1, 2], [0.3, 0.275, 0.0]),
        "env/points": ([0, 1, 2], [20.0, 22.0, 12.5]),
    }
    groups = split_by_scale(series)
    # rates apart from the rest (an all-zero rate with them); 46.75 and 22 are within a factor 5, 4.675 is not
    assert [list(g) for g in groups] == [
        ["env/cooperation_rate/Alice", "env/draw", "env/mutual_cooperation_rate"],
        ["env/collective_payoff", "env/points"],
        ["env/collective_payoff_per_round"],
    ]
    assert [scale_title("Env", g, 3) for g in groups] == [
        "Env: rates and shares (0-1)", "Env: values up to 46.8", "Env: env/collective_payoff_per_round"
    ]  # fmt: skip
    assert scale_title("Env", groups[0], 1) == "Env"
    figures = page_data(ipd_run)[0]["figures"]
    assert [(f["id"], f["title"]) for f in figures] == [
        ("outcome", "Normalised outcome of the trained seats"),
        ("losses", "Losses: loss/value"),
        ("losses-2", "Losses: loss/policy"),
        ("environment", "Environment metrics (rollouts): rates and shares (0-1)"),
        ("environment-2", "Environment metrics (rollouts): env/collective_payoff"),
        ("environment-3", "Environment metrics (rollouts): env/collective_payoff_per_round"),
    ]
    assert figures[2]["series"] == {"loss/policy": [[0, 0.0123], [1, -0.00598], [2, 0.0201]]}


def test_the_newcomers_page_in_chromium_leads_with_what_was_learned(ipd_run, tmp_path):
    path, _ = write_page(ipd_run)
    errors: list[str] = []
    with chromium_tab(errors) as tab:
        tab.goto(path.as_uri())
        assert tab.inner_text("#headline") == (
            "Held-out outcome against always-cooperate: 0.800 ± 0.021 (iteration 0) → 0.860 ± 0.018 "
            "(iteration 3), +0.060, 2.2 SE"
        )
        assert tab.inner_text("#behaviour") == (
            "Held-out mutual cooperation: 0.750 (iteration 0) → 0.650 (iteration 3), -0.100: it defects more "
            "Watch the trained policy: 4 games of the final held-out evaluation"
        )
        assert tab.locator("#behaviour").bounding_box()["y"] < 300  # in the header, not off-screen
        # round ticks spanning the data (-0.00598 .. 0.0201), never the data's own ends
        ticks = tab.locator("[data-figure=losses-2] text.ytick").all_text_contents()
        assert ticks == ["-0.01", "0", "0.01", "0.02", "0.03"]
        payoff = tab.locator("[data-figure=environment-2] text.ytick").all_text_contents()
        assert payoff == ["35", "40", "45", "50"]
        legends = [len(tab.locator(f"[data-figure={f}] .legend span").all()) for f in ("outcome", "environment")]
        assert legends == [2, 3]  # outcome and eval/outcome; the three rates (env/draw has points: all 0)
        assert "method.gamma is 0" in tab.inner_text("#eval-note")
        assert "live is the policy being trained" in tab.inner_text("#seat-key")
        tab.click("#watch-final")
        rows = tab.locator("#episode-table tbody tr")
        assert rows.count() == 4 and tab.locator("#episode-table .badge.final").count() == 4
        rows.nth(0).click()
        assert "the final held-out evaluation" in tab.inner_text("#detail-panel h3")
        tab.screenshot(path=str(tmp_path / "newcomer.png"), full_page=True)
        data, _ = page_data(ipd_run)
        data["figures"][0]["series"]["ghost"] = [[0, None], [1, None]]  # a gap everywhere: no line, no entry
        ghost = tmp_path / "ghost.html"
        ghost.write_text(render_page(data))
        tab.goto(ghost.as_uri())
        assert tab.locator("[data-figure=outcome] .legend span").all_inner_texts() == ["eval/outcome", "outcome"]
    assert errors == []
