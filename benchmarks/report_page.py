"""Size and speed of a run's report page as the run grows: ``python benchmarks/report_page.py [--episodes 2400]
[--iterations 8] [--env werewolf]``.

Builds a run directory of bot-played episodes spread over ``iterations`` (with the credit of every turn, as
training writes it), then for each page size (the default sample of 300 episodes, and all of them) prints one
JSON object: the seconds to write the page, its size in MiB, and in Debian's Chromium (headless, through
Playwright) the seconds until the page has rendered, until a filter has been applied, and until an episode's
seat view has opened. The baseline is the same run's page with 25 episodes (one page of the browser): the
ratios say what each episode costs beyond the page's fixed part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from repertory.agents.resolve import make_agent
from repertory.envs import env_class
from repertory.report.page import write_page
from repertory.rollout import run_episodes, schedule
from repertory.runs import RunDir
from repertory.store import write_credit, write_episodes

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]  # fmt: skip


def build_run(root: Path, env: str, episodes: int, iterations: int) -> Path:
    """A run directory of ``episodes`` bot games over ``iterations``, every turn credited."""
    cls = env_class(env)
    bot = make_agent(next(iter(cls.bots)), cls)
    run = RunDir(root / "run")
    run.create(f"rollout:\n  env: {env}\n")
    run.metrics.write_text(
        "".join(json.dumps({"iteration": i, "outcome": 0.4 + 0.01 * i, "loss/policy": 1.0 / (i + 1)}) + "\n"
                for i in range(iterations))
    )  # fmt: skip
    per = episodes // iterations
    for i in range(iterations):
        played = run_episodes(schedule(env, [bot] * len(cls.roles), per, seed=i))
        played = [dataclasses.replace(ep, iteration=i, episode_id=f"{ep.episode_id}/it{i}") for ep in played]
        write_episodes(run.episodes(i), played)
        rows = [
            {"episode_id": ep.episode_id, "seat_id": t.seat_id, "turn_index": t.turn_index,
             "advantage": 0.1 * (k % 7 - 3), "return": 0.5}
            for ep in played for k, t in enumerate(ep.turns)
        ]  # fmt: skip
        write_credit(run.credit(i), rows)
    return run.root


def measure(run: Path, max_episodes: int, browser) -> dict[str, float]:
    start = time.perf_counter()
    path, _ = write_page(run, max_episodes)
    written = time.perf_counter() - start
    tab = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    start = time.perf_counter()
    tab.goto(path.as_uri())
    tab.wait_for_selector("#episode-table tbody tr")
    rendered = time.perf_counter() - start
    start = time.perf_counter()
    tab.select_option("#f-iteration", "1")
    tab.wait_for_function("document.getElementById('episode-count').textContent.includes(' of ')")
    filtered = time.perf_counter() - start
    start = time.perf_counter()
    tab.locator("#episode-table tbody tr").first.click()
    tab.wait_for_selector("#detail-panel .transcript")
    opened = time.perf_counter() - start
    shown = tab.evaluate("JSON.parse(document.getElementById('run-data').textContent).episodes.length")
    tab.close()
    if errors:
        raise RuntimeError(f"the page raised: {errors}")
    return {
        "episodes_in_page": shown,
        "write_s": round(written, 3),
        "size_mib": round(path.stat().st_size / 2**20, 3),
        "render_s": round(rendered, 3),
        "filter_s": round(filtered, 3),
        "open_episode_s": round(opened, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2400)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--env", default="werewolf")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        run = build_run(Path(tmp), args.env, args.episodes, args.iterations)
        built = {"built_episodes": args.episodes, "env": args.env, "build_s": round(time.perf_counter() - start, 1)}
        print(json.dumps(built))
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            try:
                baseline = measure(run, 25, browser)
                print(json.dumps({"case": "baseline (25 episodes)", **baseline}))
                for limit in (300, args.episodes):
                    result = measure(run, limit, browser)
                    ratios = {f"{k}_vs_baseline": round(result[k] / baseline[k], 2) for k in ("size_mib", "render_s")}
                    print(json.dumps({"case": f"max_episodes={limit}", **result, **ratios}))
            finally:
                browser.close()


if __name__ == "__main__":
    main()
