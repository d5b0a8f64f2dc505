"""Cross-play evaluation (algorithms.md 8.2, 8.4): the matrices M and W over both seat orders,
Bradley-Terry ratings with worked examples E1 and E2, per-agent cooperation metrics, the classic
IPD strategy each agent plays most like, and `repertory eval crossplay`.

The spec's per-episode cooperation examples M1-M3 are replayed through the environments in
test_envs.py; here the per-agent aggregation of those metrics is checked on exact bot games.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_cli as run

from repertory import cli
from repertory.agents.resolve import make_agent
from repertory.envs import env_class, env_names
from repertory.envs.ipd import STRATEGIES, fit_strategy, moves_of
from repertory.eval.crossplay import (
    CrossPlay,
    bradley_terry,
    check_sides,
    crossplay,
    crossplay_report,
)
from repertory.eval.scores import summarize
from repertory.rollout import agent_seats
from repertory.stats import mean_se
from repertory.types import Episode, Kernel, RepertoryError, Result, RoleResult, Seat

IPD_BOTS = ["always-cooperate", "always-defect", "tit-for-tat", "grim-trigger"]


def bots_crossplay(env: str, names: list[str], episodes: int, seed: int = 0) -> CrossPlay:
    cls = env_class(env)
    return crossplay(env, {name: make_agent(name, cls) for name in names}, episodes, seed)


def games(a: str, b: str, wins: int, losses: int, draws: int = 0) -> list[tuple[str, str, float]]:
    return [(a, b, 1.0)] * wins + [(a, b, 0.0)] * losses + [(a, b, 0.5)] * draws


# --------------------------------------------------------------------------------------------
# Bradley-Terry ratings
# --------------------------------------------------------------------------------------------


def test_e1_one_pair_with_and_without_the_virtual_draw():
    x_beats_base = games("X", "base", 30, 10)
    plain = bradley_terry(["base", "X"], x_beats_base, prior=False, anchor="base")
    assert plain.rating["base"] == 1000.0
    assert plain.rating["X"] == pytest.approx(1190.8485, abs=1e-4)
    assert plain.rating["X"] == pytest.approx(1000 + 400 * math.log10(3), abs=1e-9)
    with_prior = bradley_terry(["base", "X"], x_beats_base, anchor="base")
    assert with_prior.rating["X"] == pytest.approx(1185.2442, abs=1e-4)
    assert with_prior.games == {"base": 40, "X": 40} and with_prior.score == {"base": 10.0, "X": 30.0}
    assert with_prior.connected and with_prior.anchors == ["base"] and with_prior.notes() == []


def test_e2_three_agents_with_prior():
    played = games("aa", "base", 30, 10) + games("naive", "base", 25, 15) + games("aa", "naive", 22, 18)
    ratings = bradley_terry(["base", "naive", "aa"], played, anchor="base")
    assert ratings.rating["base"] == pytest.approx(1000.0, abs=1e-4)
    assert ratings.rating["naive"] == pytest.approx(1107.2635, abs=1e-4)
    assert ratings.rating["aa"] == pytest.approx(1160.8202, abs=1e-4)


def test_ratings_do_not_depend_on_game_order_and_ignore_self_play():
    played = games("aa", "base", 30, 10) + games("naive", "base", 25, 15) + games("aa", "naive", 22, 18)
    reference = bradley_terry(["base", "naive", "aa"], played, anchor="base").rating
    shuffled = played[::-1] + games("aa", "aa", 40, 0) + games("base", "base", 0, 5)
    again = bradley_terry(["base", "naive", "aa"], shuffled, anchor="base")
    assert again.rating == pytest.approx(reference, abs=1e-9)
    assert again.games == {"base": 80, "naive": 80, "aa": 80}


def test_disconnected_line_up_is_rated_per_component_and_flagged():
    played = games("a", "b", 1, 0) + [("c", "d", 0.5), ("d", "c", 0.0)] + games("d", "e", 1, 1)
    ratings = bradley_terry(["a", "b", "c", "d", "e", "f"], played, anchor="c")
    assert ratings.component == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1, "f": 2}
    # c anchors its component as asked; a (first of two equally connected) and f (alone) anchor theirs.
    assert ratings.anchors == ["a", "c", "f"] and not ratings.connected
    assert ratings.rating["a"] == ratings.rating["c"] == ratings.rating["f"] == 1000.0
    # a: 1 win + a virtual draw against b -> strengths 3 : 1.
    assert ratings.rating["b"] == pytest.approx(1000 - 400 * math.log10(3), abs=1e-9)
    assert ratings.games["f"] == 0 and ratings.games["d"] == 4
    [note] = ratings.notes()
    assert "not connected" in note and "a, c, f" in note


def test_missing_anchor_falls_back_to_the_best_connected_agent_and_says_so():
    played = games("a", "b", 3, 1) + games("b", "c", 2, 2) + games("c", "b", 1, 0)
    ratings = bradley_terry(["a", "b", "c"], played, anchor="base")
    assert ratings.anchors == ["b"] and ratings.rating["b"] == 1000.0
    assert ratings.rating["a"] > 1000.0
    assert ratings.notes() == [
        "base is not in the line-up: rated 1000 is the best-connected member (most distinct opponents, "
        "then most games, then first in the line-up): b"
    ]
    # Two opponents each: a and c played 5 games, b 4; of a and c, c comes first in the line-up.
    triangle = games("a", "b", 1, 1) + games("b", "c", 1, 1) + games("a", "c", 2, 1)
    assert bradley_terry(["b", "c", "a"], triangle).anchors == ["c"]
    assert bradley_terry(["a", "c"], games("a", "c", 2, 1)).anchors == ["a"]


def test_ratings_without_the_prior_need_wins_and_losses_on_every_cut():
    with pytest.raises(ValueError, match="no finite ratings"):
        bradley_terry(["a", "b"], games("a", "b", 5, 0), prior=False)
    shutout = bradley_terry(["a", "b"], games("a", "b", 5, 0))
    assert shutout.rating["b"] == pytest.approx(1000 - 400 * math.log10(11), abs=1e-9)


def test_ratings_reject_unknown_agents_and_scores():
    with pytest.raises(ValueError, match="not in the line-up"):
        bradley_terry(["a", "b"], [("a", "z", 1.0)])
    with pytest.raises(ValueError, match="scores 1, 0.5 or 0"):
        bradley_terry(["a", "b"], [("a", "b", 0.7)])


# --------------------------------------------------------------------------------------------
# M, W, points, cooperation on exact bot games
# --------------------------------------------------------------------------------------------


def test_ipd_always_cooperate_vs_always_defect_exact():
    result = bots_crossplay("ipd", ["always-cooperate", "always-defect"], episodes=2)
    report = crossplay_report(result)
    ac, ad = "always-cooperate", "always-defect"
    assert report.episodes == 2
    assert report.outcome[ac][ad] == (0.0, 0.0) and report.outcome[ad][ac] == (1.0, 0.0)
    assert report.outcome[ac][ac] == pytest.approx((0.6, 0.0)) and report.outcome[ad][ad] == pytest.approx((0.2, 0.0))
    assert report.welfare is not None
    assert report.welfare[ac][ad][0] == pytest.approx(50 / 60) and report.welfare[ad][ac][0] == pytest.approx(50 / 60)
    assert report.welfare[ac][ac][0] == pytest.approx(1.0) and report.welfare[ad][ad][0] == pytest.approx(20 / 60)
    assert report.points[ac][ad] == {"Alice": 0.0, "Bob": 50.0}
    assert report.points[ad][ac] == {"Alice": 50.0, "Bob": 0.0}
    assert report.points[ad][ad] == {"Alice": 10.0, "Bob": 10.0}
    # always-cooperate sits in 8 seats: 4 in self-play (30 points each), 4 against always-defect (0).
    assert report.cooperation[ac] == pytest.approx(
        {
            "points": 15.0,
            "partner_points": 40.0,
            "cooperation_rate": 1.0,
            "mutual_cooperation_rate": 1 / 3,
            "collective_payoff": 160 / 3,
            "collective_payoff_per_round": 16 / 3,
            "collective_payoff_normalized": (1 + 5 / 6 + 5 / 6) / 3,
        }
    )
    assert report.cooperation[ad]["cooperation_rate"] == 0.0
    assert report.cooperation[ad]["points"] == pytest.approx(30.0)
    assert report.cooperation[ad]["partner_points"] == pytest.approx(5.0)
    assert report.cooperation[ad]["collective_payoff_normalized"] == pytest.approx(2 / 3)
    # always-defect won all 4 rated games; one virtual draw: strengths 4.5 : 0.5.
    assert report.ratings.anchors == [ac]
    assert report.ratings.rating[ad] == pytest.approx(1000 + 400 * math.log10(9), abs=1e-9)
    assert report.ratings.score == {ac: 0.0, ad: 4.0} and report.ratings.games == {ac: 4, ad: 4}


def test_tit_for_tat_against_always_defect_scores_the_same_in_both_seats():
    report = crossplay_report(bots_crossplay("ipd", ["tit-for-tat", "always-defect"], episodes=3))
    assert report.outcome["tit-for-tat"]["always-defect"] == pytest.approx((9 / 50, 0.0), abs=1e-12)
    assert report.outcome["always-defect"]["tit-for-tat"] == pytest.approx((14 / 50, 0.0), abs=1e-12)
    assert report.welfare["tit-for-tat"]["always-defect"][0] == pytest.approx(23 / 60)


def _episode(env: str, pair: tuple[str, str], outcomes: tuple[float, float], welfare: float) -> Episode:
    roles = env_class(env).roles
    return Episode(
        episode_id=f"{env}/{pair[0]}-vs-{pair[1]}",
        env=env,
        kernel=Kernel(id=f"{env}/heldout/000", env=env, split="heldout", index=0, seed=0, data={}),
        episode_seed=0,
        seats=[
            Seat(f"p{i}", role, "player", agent, f"scripted:{agent}")
            for i, (role, agent) in enumerate(zip(roles, pair))
        ],
        turns=[],
        result=Result(
            {role: RoleResult(points=100 * o, outcome=o, n_turns=10, n_invalid=0) for role, o in zip(roles, outcomes)},
            "rounds_complete",
        ),
        metrics={"collective_payoff_normalized": welfare},
    )


def test_m_pools_both_seat_orders_and_self_play_averages_both_seats():
    env = "trust-and-split"
    cells = {
        ("a", "b"): [((0.2, 0.9), 0.5), ((0.4, 0.3), 0.7)],
        ("b", "a"): [((0.1, 0.6), 0.4), ((0.3, 0.8), 0.6)],
        ("a", "a"): [((0.3, 0.5), 0.8), ((0.1, 0.1), 0.2)],
        ("b", "b"): [((0.5, 0.5), 1.0), ((0.5, 0.5), 1.0)],
    }
    games_by_cell = {pair: [_episode(env, pair, o, w) for o, w in cell] for pair, cell in cells.items()}
    summaries = {pair: summarize(cell) for pair, cell in games_by_cell.items()}
    played = [ep for cell in games_by_cell.values() for ep in cell]
    report = crossplay_report(CrossPlay(env, ["a", "b"], summaries, played, games_by_cell))
    # a: 0.2, 0.4 in the first seat of (a, b); 0.6, 0.8 in the second seat of (b, a).
    mean, se = report.outcome["a"]["b"]
    assert mean == pytest.approx(0.5) and se == pytest.approx(math.sqrt((0.09 + 0.01 + 0.01 + 0.09) / 3 / 4))
    assert report.outcome["b"]["a"][0] == pytest.approx((0.9 + 0.3 + 0.1 + 0.3) / 4)
    # Self-play: the mean of both seats per game (0.4 and 0.1), then over games.
    mean, se = report.outcome["a"]["a"]
    assert mean == pytest.approx(0.25) and se == pytest.approx(0.15)
    assert report.welfare["a"]["b"][0] == report.welfare["b"]["a"][0] == pytest.approx(0.55)
    assert report.welfare["a"]["a"] == (pytest.approx(0.5), pytest.approx(0.3))
    assert report.points["a"]["b"] == {"Alice": pytest.approx(30.0), "Bob": pytest.approx(60.0)}
    # Ratings compare points: a wins the second game of (a, b) and both of (b, a).
    assert report.ratings.score == {"a": 3.0, "b": 1.0}


def test_split_no_comm_reports_split_efficiency_and_trust_and_split_the_agents_own_honesty():
    snc = crossplay_report(bots_crossplay("split-no-comm", ["greedy", "welfare-maximizing"], episodes=2))
    assert snc.welfare["welfare-maximizing"]["welfare-maximizing"] == (1.0, 0.0)
    efficiency = snc.cooperation["welfare-maximizing"]["split_efficiency"]
    assert efficiency == snc.cooperation["welfare-maximizing"]["collective_payoff_normalized"]
    # Its 4 games in the mixed cells and 2 self-play games (efficiency 1) count once each.
    mixed = snc.welfare["greedy"]["welfare-maximizing"][0]
    assert efficiency == pytest.approx((4 * mixed + 2 * 1.0) / 6)
    tas = crossplay_report(bots_crossplay("trust-and-split", ["greedy", "honest-cooperative"], episodes=2))
    assert tas.cooperation["honest-cooperative"]["honesty_rate"] == 1.0
    # Greedy never names a hand: the games' pooled honesty rate is not credited to it.
    assert "honesty_rate" not in tas.cooperation["greedy"]
    assert tas.strategies is None and snc.strategies is None


# --------------------------------------------------------------------------------------------
# classic IPD strategies
# --------------------------------------------------------------------------------------------


def test_strategy_agreement_on_a_hand_built_history():
    # algorithms.md 8.4 M1: A = CCDCC against B = CDDCC.
    fit = fit_strategy([("AABAA", "ABBAA")])
    assert fit.moves == 5
    assert fit.agreement == pytest.approx(
        {
            "always-cooperate": 0.8,
            "always-defect": 0.2,
            "tit-for-tat": 0.8,
            "suspicious-tit-for-tat": 0.6,
            "win-stay-lose-shift": 1.0,
            "grim-trigger": 0.6,
        }
    )
    assert fit.closest == "win-stay-lose-shift"
    # B's side of the same game.
    fit = fit_strategy([("ABBAA", "AABAA")])
    assert fit.agreement == pytest.approx(
        {
            "always-cooperate": 0.6,
            "always-defect": 0.4,
            "tit-for-tat": 0.4,
            "suspicious-tit-for-tat": 0.2,
            "win-stay-lose-shift": 0.8,
            "grim-trigger": 0.2,
        }
    )
    # Pooled over games: 3 of 4 moves of the second game copy the partner.
    pooled = fit_strategy([("AABAA", "ABBAA"), ("BABA", "ABAA")])
    assert pooled.moves == 9 and pooled.agreement["tit-for-tat"] == pytest.approx((4 + 3) / 9)


def test_strategy_ties_go_to_the_simplest_strategy():
    assert list(STRATEGIES) == [
        "always-cooperate",
        "always-defect",
        "tit-for-tat",
        "suspicious-tit-for-tat",
        "win-stay-lose-shift",
        "grim-trigger",
    ]
    cooperative = fit_strategy([("AAAA", "AAAA")])
    assert {n for n, v in cooperative.agreement.items() if v == 1.0} == {
        "always-cooperate",
        "tit-for-tat",
        "win-stay-lose-shift",
        "grim-trigger",
    }
    assert cooperative.closest == "always-cooperate"
    assert fit_strategy([("BBB", "BBB")]).closest == "always-defect"
    with pytest.raises(ValueError, match="no IPD moves"):
        fit_strategy([])


def test_moves_are_read_from_the_turns(play_episodes):
    [ep] = play_episodes("ipd", ["tit-for-tat", "always-defect"])
    assert moves_of(ep, 0) == ("ABBBBBBBBB", "BBBBBBBBBB")
    assert moves_of(ep, 1) == ("BBBBBBBBBB", "ABBBBBBBBB")


def test_every_ipd_bot_is_classified_as_itself():
    report = crossplay_report(bots_crossplay("ipd", [*IPD_BOTS, "random"], episodes=4))
    assert report.strategies is not None
    for bot in IPD_BOTS:
        fit = report.strategies[bot]
        assert fit.closest == bot and fit.agreement[bot] == 1.0
        assert sorted(fit.agreement.values())[-2] < 1.0
        # 4 games in each of 9 cells with it, two seats in self-play: 10 cells' worth of seats.
        assert fit.moves == 4 * 10 * 10
    assert max(report.strategies["random"].agreement.values()) < 0.9


# --------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------

LINE_UP = "always-cooperate,always-defect,tit-for-tat"


def test_eval_crossplay_json(capsys):
    code, out, err = run(capsys, "eval", "crossplay", "--env", "ipd", "--agents", LINE_UP, "-n", "2", "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    agents = LINE_UP.split(",")
    assert report["env"] == "ipd" and report["agents"] == agents and report["episodes"] == 2
    for key in ("M", "M_se", "W", "W_se", "points"):
        assert list(report[key]) == agents and all(list(row) == agents for row in report[key].values())
    assert report["M"]["always-cooperate"]["always-defect"] == 0.0
    assert report["M"]["tit-for-tat"]["always-defect"] == pytest.approx(0.18)
    assert report["M"]["tit-for-tat"]["always-cooperate"] == pytest.approx(0.6)
    assert report["M_se"]["tit-for-tat"]["always-defect"] == pytest.approx(0.0, abs=1e-12)
    assert report["W"]["always-defect"]["always-defect"] == pytest.approx(1 / 3)
    assert report["points"]["tit-for-tat"]["always-defect"] == {"Alice": 9.0, "Bob": 14.0}
    ratings = report["ratings"]
    assert ratings["anchors"] == ["always-cooperate"] and ratings["connected"] is True
    assert ratings["rating"]["always-cooperate"] == 1000.0
    # Tit-for-tat, like always-cooperate, draws against always-cooperate and loses to always-defect.
    assert ratings["rating"]["tit-for-tat"] == pytest.approx(1000.0) and ratings["rating"]["always-defect"] > 1100
    assert ratings["games"] == {a: 8 for a in agents} and ratings["notes"][0].startswith("base is not in the line-up")
    # 12 seats: 4 in self-play and 4 against always-cooperate (all A), 4 against always-defect (A once).
    assert report["cooperation"]["tit-for-tat"]["cooperation_rate"] == pytest.approx((8 * 1.0 + 4 * 0.1) / 12)
    assert {a: s["closest"] for a, s in report["strategies"].items()} == {a: a for a in agents}


def test_eval_crossplay_tables_and_heat_map(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli.out, "width", 240)
    code, out, err = run(
        capsys, "eval", "crossplay", "-e", "ipd", "-a", LINE_UP, "-n", "2", "--out", str(tmp_path / "figs")
    )
    assert code == 0 and err == ""
    assert "M, mean normalised outcome of row vs column (4 games, 2 in each seat" in out
    assert "0.000 ± 0.000" in out and "0.180 ± 0.000" in out
    assert "W, mean normalised collective payoff" in out and "0.833 ± 0.000" in out
    assert "9 / 14" in out
    assert "Bradley-Terry ratings" in out and "always-cooperate (anchor)" in out and "note: base is not" in out
    assert "cooperation per agent" in out and "mutual_cooperation_rate" in out
    assert "suspicious-tit-for-tat" in out and "win-stay-lose-shift" in out
    figure = tmp_path / "figs" / "crossplay-ipd.png"
    assert f"heat map: {figure}; results: {figure.with_suffix('.json')}" in out
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(figure.with_suffix(".json").read_text())
    assert saved["agents"] == LINE_UP.split(",") and saved["W"]["always-cooperate"]["always-cooperate"] == 1.0


def test_eval_crossplay_json_with_out_keeps_stdout_json(capsys, tmp_path):
    code, out, err = run(
        capsys,
        "eval",
        "crossplay",
        "-e",
        "split-no-comm",
        "-a",
        "greedy,welfare-maximizing",
        "-n",
        "1",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0 and json.loads(out)["strategies"] is None
    saved = tmp_path / "crossplay-split-no-comm.json"
    assert err.strip().startswith(f"heat map: {tmp_path / 'crossplay-split-no-comm.png'}; results: {saved}")
    assert json.loads(saved.read_text()) == json.loads(out)


@pytest.mark.parametrize(
    "args,message",
    [
        (["eval", "crossplay", "--env", "ipd"], "crossplay needs --agents"),
        (["eval", "crossplay", "--agents", LINE_UP], "crossplay needs --env"),
        (["eval", "crossplay", "-e", "chess", "-a", LINE_UP], "unknown environment 'chess'"),
        (["eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat,nobody"], "unknown agent 'nobody' for ipd"),
        (["eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat,random,tit-for-tat"], "'tit-for-tat' appears twice"),
        (["eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat,"], "--agents has an empty name"),
        (["eval", "crossplay", "-e", "ipd", "-a", "tit-for-tat"], "at least two agents"),
        (["eval", "crossplay", "-e", "ipd", "-a", LINE_UP, "-n", "0"], "--episodes must be at least 1"),
        (["eval", "crossplay", "-e", "ipd", "-a", LINE_UP, "--vs", "random"], "No such option: --vs"),
        (["eval", "base", "-e", "ipd", "--agents", LINE_UP], "No such option: --agents"),
        (["eval", "policy", "base", "--victim", "random"], "No such option: --victim"),
        (["eval", "--env", "ipd", "base", "-n", "0"], "--episodes must be at least 1"),  # options may come first
        (["eval", "-e", "ipd", "crossplay", "-a", "tit-for-tat"], "at least two agents"),  # before a sub-command too
        (["eval", "crosplay", "-e", "ipd"], "no sub-command 'crosplay' of eval (nor a run directory); did you mean"),
        (["eval", "runs/x", "--out", "figs"], "No such option: --out"),
    ],
)
def test_eval_crossplay_errors_are_one_line_with_status_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_eval_crossplay_out_that_is_a_file_is_rejected_before_playing(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    code, out, err = run(capsys, "eval", "crossplay", "-e", "ipd", "-a", LINE_UP, "--out", str(target))
    assert code == 2 and out == "" and err == f"error: --out {target} is not a directory\n"
    assert target.read_text() == "keep me"


def test_eval_crossplay_takes_run_directories_as_agents(capsys, tmp_path):
    run_dir = tmp_path / "omar-ipd-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("iterations: 1\n")
    code, out, err = run(capsys, "eval", "crossplay", "-e", "ipd", "-a", f"tit-for-tat,{run_dir}")
    assert code == 2 and err == f"error: run {run_dir} has no complete checkpoint yet\n"


# --------------------------------------------------------------------------------------------
# team games: one agent per team (werewolf)
# --------------------------------------------------------------------------------------------

H, R = "heuristic", "random-legal"


def own_seats(ep: Episode, agent: str) -> list[int]:
    return [s for s, seat in enumerate(ep.seats) if seat.agent == agent]


def team_mean(ep: Episode, seats: list[int]) -> float:
    return sum(ep.result.roles[ep.seats[s].name].outcome for s in seats) / len(seats)


def team_seats(ep: Episode) -> list[list[int]]:
    """The seats of the village and of the wolves, as this game's kernel deals them."""
    cls = env_class(ep.env)
    teams = cls.seat_teams(ep.kernel.data)
    return [[s for s in range(len(teams)) if teams[s] == team] for team in cls.teams]


@pytest.fixture(scope="module")
def werewolf():
    result = bots_crossplay("werewolf", [H, R], episodes=6)
    return result, crossplay_report(result)


def test_team_cells_pair_every_game_with_the_teams_swapped(werewolf):
    result, _ = werewolf
    cls = env_class("werewolf")
    assert len(result.episodes) == 4 * 6 and all(len(cell) == 6 for cell in result.games.values())
    for first, second, *self_play in zip(*(result.games[pair] for pair in ((H, R), (R, H), (H, H), (R, R)))):
        same = {(ep.kernel.id, ep.episode_seed) for ep in (first, second, *self_play)}
        assert len(same) == 1 and first.kernel.split == "heldout"
        village, wolves = team_seats(first)
        assert len(village) == 4 and len(wolves) == 2
        # The row agent holds exactly the village's seats of this kernel's deal, the column agent the wolves'.
        assert own_seats(first, H) == village and own_seats(first, R) == wolves
        assert own_seats(second, R) == village and own_seats(second, H) == wolves
        assert agent_seats(cls, first.kernel, 0) == village and agent_seats(cls, first.kernel, 1) == wolves
        assert [s.name for s in first.seats] == list(cls.seat_names(first.kernel.data))
    assert len({ep.kernel.id for ep in result.games[(H, R)]}) == 6


def test_team_matrices_ratings_and_records_recomputed_from_the_episodes(werewolf):
    result, report = werewolf
    games = result.games
    assert report.episodes == 6 and report.welfare is None and report.strategies is None
    assert report.cooperation == {}
    # M: the agent's mean seat outcome per game, on the village in (a, b) and the wolves in (b, a).
    for a, b in ((H, R), (R, H)):
        values = [team_mean(ep, own_seats(ep, a)) for ep in games[(a, b)] + games[(b, a)]]
        assert report.outcome[a][b] == pytest.approx(mean_se(values), abs=1e-12)
    # Self-play: both teams weigh the same, whatever their sizes (4 and 2 seats).
    for a in (H, R):
        values = [sum(team_mean(ep, seats) for seats in team_seats(ep)) / 2 for ep in games[(a, a)]]
        assert report.outcome[a][a] == pytest.approx(mean_se(values), abs=1e-12)
    cls = env_class("werewolf")

    def wins(cell: list[Episode], team: str) -> float:
        return sum(ep.result.info["winner"] == team for ep in cell) / len(cell)

    # "Points" of a team game: the row agent's village win rate / the column agent's wolves win rate.
    for pair, cell in games.items():
        assert report.points[pair[0]][pair[1]] == pytest.approx({t: wins(cell, t) for t in cls.teams})
        assert result.cells[pair].agents == list(pair) and result.cells[pair].episodes == 6
        assert result.cells[pair].metrics["village_win"] == pytest.approx(wins(cell, "village"))
    # Ratings score team wins: heuristic's village wins in (H, R) and wolves wins in (R, H), draws half.
    score = sum({"village": 1.0, "draw": 0.5}.get(ep.result.info["winner"], 0.0) for ep in games[(H, R)])
    score += sum({"wolves": 1.0, "draw": 0.5}.get(ep.result.info["winner"], 0.0) for ep in games[(R, H)])
    assert report.ratings.score == pytest.approx({H: score, R: 12 - score})
    assert report.ratings.games == {H: 12, R: 12}
    # Records per team: 6 games against the other agent and 6 in self-play, on either team.
    for a, b in ((H, R), (R, H)):
        village = games[(a, b)] + games[(a, a)]
        wolves = games[(b, a)] + games[(a, a)]
        record = report.teams[a]
        assert record["village"].episodes == record["wolves"].episodes == 12
        assert record["village"].win_rate == pytest.approx(mean_se([wins([ep], "village") for ep in village]))
        assert record["wolves"].win_rate == pytest.approx(mean_se([wins([ep], "wolves") for ep in wolves]))
        assert record["wolves"].draw_rate[0] == pytest.approx(wins(wolves, "draw"))
        survival = sum(ep.metrics["wolf_survival"] for ep in wolves) / 12
        assert record["wolves"].metrics["wolf_survival"] == pytest.approx(survival)
        assert record["village"].invalid_rate == 0.0
    # The tournament's ranking weighs each (game, team) the agent played once.
    played = [team_mean(ep, own_seats(ep, H)) for ep in games[(H, R)] + games[(R, H)]]
    played += [team_mean(ep, seats) for ep in games[(H, H)] for seats in team_seats(ep)]
    assert result.agent_outcome(H) == pytest.approx(sum(played) / len(played))


def test_cross_play_needs_two_seats_or_two_teams():
    trio = type("Trio", (), {"name": "trio", "teams": (), "roles": ("a", "b", "c")})
    with pytest.raises(RepertoryError, match="needs a two-seat or two-team environment; trio has 3 seats"):
        check_sides(trio)
    factions = type("Factions", (), {"name": "factions", "teams": ("x", "y", "z"), "roles": tuple("abcdef")})
    with pytest.raises(RepertoryError, match="factions has 3 teams"):
        check_sides(factions)
    check_sides(env_class("werewolf"))
    check_sides(env_class("ipd"))


def test_eval_crossplay_on_a_team_game(capsys, monkeypatch, werewolf):
    code, out, err = run(capsys, "eval", "crossplay", "-e", "werewolf", "-a", f"{H},{R}", "-n", "6", "--json")
    assert code == 0 and err == ""
    data, (_, report) = json.loads(out), werewolf
    for a in (H, R):
        assert data["M"][a] == pytest.approx({b: m for b, (m, _) in report.outcome[a].items()})
        assert data["M_se"][a] == pytest.approx({b: se for b, (_, se) in report.outcome[a].items()})
        for b in (H, R):
            assert data["points"][a][b] == pytest.approx(report.points[a][b])
    assert data["W"] is None and data["cooperation"] == {} and data["strategies"] is None
    assert set(data["teams"][H]) == {"village", "wolves"}
    assert data["teams"][H]["village"]["win_rate"] == pytest.approx(report.teams[H]["village"].win_rate[0])
    assert {"vote_accuracy", "seer_found", "wolf_survival"} <= set(data["teams"][R]["wolves"]["metrics"])
    monkeypatch.setattr(cli.out, "width", 240)
    code, out, err = run(capsys, "eval", "crossplay", "-e", "werewolf", "-a", f"{H},{R}", "-n", "6")
    assert code == 0 and err == ""
    assert "M, mean normalised outcome of row vs column (12 games, 6 on each team" in out
    village, wolves = report.points[H][R]["village"], report.points[H][R]["wolves"]
    assert "win rate, village (row) / wolves (column), 6 games per cell" in out
    assert f"{village:.3f} / {wolves:.3f}" in out
    assert "draw 0.5 on team wins" in out and "cooperation per agent" not in out
    assert f"werewolf: {H} per team" in out and f"werewolf: {R} per team" in out
    for column in ("win rate", "draws", "vote accuracy", "seer found", "wolf survival", "invalid"):
        assert column in out


def test_tournament_on_a_team_game(capsys, monkeypatch):
    monkeypatch.setattr(cli.out, "width", 240)
    code, out, err = run(capsys, "tournament", "--env", "werewolf", "-n", "2")
    assert code == 0 and err == ""
    assert "werewolf: win rate, village (row) / wolves (column)" in out
    assert "mean outcome over all games, either team" in out
    assert "werewolf: random-legal per team" in out and "werewolf: heuristic per team" in out
    assert "seer found" in out and "wolf survival" in out
    code, out, _ = run(capsys, "tournament", "--env", "werewolf", "-n", "2", "--json")
    data = json.loads(out)
    assert data["agents"] == [R, H] and len(data["pairs"]) == 4
    result = bots_crossplay("werewolf", [R, H], episodes=2)
    assert data["mean_outcome"] == pytest.approx({a: result.agent_outcome(a) for a in (R, H)})
    for pair in data["pairs"]:
        cell = result.cells[tuple(pair["agents"])]
        assert pair["points"] == pytest.approx({t: m for t, (m, _) in cell.points.items()})
        assert set(pair["points"]) == {"village", "wolves"}
    assert data["teams"][H]["village"]["episodes"] == 4


def test_tournament_over_every_environment_includes_the_team_game(capsys):
    code, out, err = run(capsys, "tournament", "-n", "1", "--json")
    assert code == 0 and err == ""
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["env"] for r in results] == [n for n in env_names() if n != "social"]  # social has three seats
    [team_game] = [r for r in results if r["env"] == "werewolf"]
    assert len(team_game["pairs"]) == 4 and set(team_game["teams"]) == {R, H}
