"use strict";
// The run's page: every value comes from the JSON element written by repertory.report.page; text from
// transcripts is only ever set through textContent, never parsed as HTML.
const DATA = JSON.parse(document.getElementById("run-data").textContent);
const PAGE_SIZE = 25;
const COLOURS = ["#2459a8", "#c62828", "#2e7d32", "#b35c00", "#7b1fa2", "#00838f", "#6d4c41", "#ad1457", "#558b2f",
  "#37474f"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) if (child !== null && child !== undefined) node.append(child);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

// A value with `digits` decimals; an integer bare unless `fixed` (a rate of exactly 1 reads "1.000" beside "0.562").
function num(value, digits = 3, fixed = false) {
  if (value === null || value === undefined) return "—";
  if (Number.isInteger(value) && !fixed) return String(value);
  return Number(value).toFixed(digits);
}

function signed(value) {
  return value === null || value === undefined ? "—" : (value >= 0 ? "+" : "") + Number(value).toFixed(3);
}

// Learning curves

function ticks(lo, hi, n) {
  if (lo === hi) return [lo];
  const step = (hi - lo) / (n - 1);
  return Array.from({length: n}, (_, i) => lo + i * step);
}

// About `count` ticks at a round step (1, 2 or 5 x 10^k) from a multiple below `lo` to one above `hi`: the axis
// spans them, so every label is a short round number (0.01, not 0.00598).
function niceTicks(lo, hi, count) {
  const raw = (hi - lo) / (count - 1);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= raw * (1 - 1e-9));
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const values = [];
  for (let i = Math.floor(lo / step + 1e-9); i <= Math.ceil(hi / step - 1e-9); i++) {
    values.push(Number((i * step).toFixed(decimals)));
  }
  return values;
}

function tickLabel(value) {
  if (Math.abs(value) >= 1e6) return `${Number((value / 1e6).toPrecision(3))}M`;
  if (Math.abs(value) >= 1e4) return `${Number((value / 1e3).toPrecision(3))}k`;
  return String(value);
}

// Bounds by a loop: spreading a long series into Math.min would overflow the call stack.
function bounds(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}

function drawChart(figure) {
  const width = 460, height = 220, left = 48, right = 10, top = 8, bottom = 24;
  const drawn = Object.entries(figure.series)
    .map(([key, points]) => [key, points.filter(p => Number.isFinite(p[0]) && Number.isFinite(p[1]))])
    .filter(([, points]) => points.length);  // a series without points has no line, so no legend entry
  const all = drawn.flatMap(([, points]) => points);
  if (!all.length) return null;
  const [x0, x1] = bounds(all.map(p => p[0]));
  let [lo, hi] = bounds(all.map(p => p[1]));
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  const yTicks = niceTicks(lo, hi, 5);
  const [y0, y1] = [yTicks[0], yTicks[yTicks.length - 1]];
  const sx = x => left + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (width - left - right);
  const sy = y => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  const chart = svg("svg", {viewBox: `0 0 ${width} ${height}`, width, height, role: "img"});
  for (const y of yTicks) {
    chart.append(svg("line", {x1: left, x2: width - right, y1: sy(y), y2: sy(y), stroke: "#e6e9ed"}));
    const label = svg("text", {x: left - 4, y: sy(y) + 3, "text-anchor": "end", class: "ytick"});
    label.textContent = tickLabel(y);
    chart.append(label);
  }
  for (const x of [...new Set(ticks(x0, x1, Math.min(6, x1 - x0 + 1)).map(Math.round))]) {
    const label = svg("text", {x: sx(x), y: height - 8, "text-anchor": "middle"});
    label.textContent = String(x);
    chart.append(label);
  }
  const legend = el("div", {class: "legend"});
  drawn.forEach(([key, shown], i) => {
    const colour = COLOURS[i % COLOURS.length];
    chart.append(svg("polyline", {points: shown.map(p => `${sx(p[0])},${sy(p[1])}`).join(" "), fill: "none",
      stroke: colour, "stroke-width": 1.6}));
    if (shown.length < 40) {
      for (const [x, y] of shown) {
        const dot = svg("circle", {cx: sx(x), cy: sy(y), r: 2.6, fill: colour});
        const tip = svg("title", {});
        tip.textContent = `${key} @ ${x}: ${num(y, 4)}`;
        dot.append(tip);
        chart.append(dot);
      }
    }
    legend.append(el("span", {style: `--c:${colour}`, text: key}));
  });
  return el("div", {class: "chart", "data-figure": figure.id}, el("h3", {text: figure.title}), chart, legend);
}

function renderCurves() {
  const box = document.getElementById("charts");
  const charts = DATA.figures.map(drawChart).filter(chart => chart !== null);
  if (!charts.length) box.append(el("p", {class: "muted", text: "No metrics lines yet."}));
  box.append(...charts);
}

// Evaluations

function heat(value) {
  if (value === null || value === undefined) return "#9e9e9e";
  const v = Math.max(0, Math.min(1, value));
  return `hsl(${Math.round(220 - 180 * v)}, 60%, ${Math.round(38 + 10 * v)}%)`;
}

function matrixTable(title, agents, matrix, errors) {
  const head = el("tr", {}, el("th", {text: "row \\ column"}), ...agents.map(a => el("th", {text: a})));
  const rows = agents.map(a => el("tr", {}, el("th", {text: a}), ...agents.map(b => {
    const value = (matrix[a] || {})[b];
    const se = errors ? (errors[a] || {})[b] : null;
    return el("td", {class: "heat", style: `background:${heat(value)}`,
      text: num(value) + (se !== null && se !== undefined ? ` ± ${num(se)}` : "")});
  })));
  return [el("h3", {text: title}), el("table", {class: "grid matrix"}, el("thead", {}, head), el("tbody", {}, ...rows))];
}

function renderEvaluations() {
  const box = document.getElementById("eval-tables");
  const evals = DATA.evaluations;
  if (evals.rows.length) {
    const head = el("tr", {}, el("th", {text: "iteration"}), ...evals.columns.map(c => el("th", {text: c})));
    const body = evals.rows.map(row => el("tr", {}, el("td", {class: "num", text: String(row.iteration)}),
      ...evals.columns.map(c => {
        const seKey = c.replace(/^(outcome|discounted_return)/, "$1_se");
        const se = seKey === c ? null : row[seKey];
        const text = num(row[c]) + (se !== undefined && se !== null ? ` ± ${num(se)}` : "");
        return el("td", {class: "num", text});
      })));
    box.append(el("h3", {text: "Held-out evaluations (iteration k: the policy before its update; the last row: after the last)"}),
      el("div", {class: "scroll"}, el("table", {class: "grid", id: "heldout-table"}, el("thead", {}, head),
        el("tbody", {}, ...body))));
    if (evals.note) box.append(el("p", {class: "muted", id: "eval-note", text: evals.note}));
  }
  for (const result of DATA.crossplay) {
    box.append(...matrixTable(`Cross-play ${result.env} (${result.file}): M, mean normalised outcome of row vs column`,
      result.agents, result.M, result.M_se));
    if (result.W) box.append(...matrixTable("W: mean normalised collective payoff", result.agents, result.W, result.W_se));
    if (result.teams) {
      const teams = [...new Set(Object.values(result.teams).flatMap(t => Object.keys(t)))];
      const head = el("tr", {}, el("th", {text: "agent"}), ...teams.map(t => el("th", {text: `${t} win rate`})));
      const rows = Object.entries(result.teams).map(([agent, records]) => el("tr", {}, el("th", {text: agent}),
        ...teams.map(t => el("td", {class: "num", text: records[t] ? `${num(records[t].win_rate)} ± ${num(records[t].win_rate_se)} (${records[t].episodes})` : "—"}))));
      box.append(el("h3", {text: "Team win rates"}), el("table", {class: "grid"}, el("thead", {}, head), el("tbody", {}, ...rows)));
    }
  }
  if (!box.children.length) box.append(el("p", {class: "muted", text: "This run has no held-out evaluation or cross-play result."}));
}

// The run's headline: did the held-out outcome rise, by how many standard errors of the difference?
function renderHeadline() {
  const h = DATA.headline;
  const box = document.getElementById("headline");
  if (!h) { box.remove(); return; }
  const size = h.standard_errors === null ? "neither evaluation varied" : `${Number(h.standard_errors).toFixed(1)} SE`;
  const against = h.opponent ? ` against ${h.opponent}` : "";
  box.append(el("strong", {text: `Held-out outcome${against}: `}),
    `${num(h.before)} ± ${num(h.before_se)} (iteration ${h.first_iteration}) → ${num(h.after)} ± ${num(h.after_se)} ` +
    `(iteration ${h.last_iteration}), ${signed(h.rise)}, ${size}`);
}

// Beside it, what the policy learned: the change in the game's key behaviour, and a way to watch it play.
function renderBehaviour() {
  const b = DATA.behaviour;
  const box = document.getElementById("behaviour");
  const finals = DATA.episodes.filter(ep => ep.source === "final").length;
  if (b) {
    box.append(el("strong", {text: `Held-out ${b.label}: `}),
      `${num(b.before, 3, true)} (iteration ${b.first_iteration}) → ${num(b.after, 3, true)} (iteration ${b.last_iteration}), ` +
      `${signed(b.change)}: `, el("strong", {text: b.verdict}));
  }
  if (finals) {
    box.append(" ", el("a", {href: "#episodes", id: "watch-final", onclick: () => {
      filters.source.value = "final"; state.page = 0; renderEpisodes();
    }, text: `Watch the trained policy: ${finals} games of the final held-out evaluation`}));
  }
  if (!box.childNodes.length) box.remove();
}

// Episodes

const state = {page: 0, selected: null, seat: null};
const filters = {
  source: document.getElementById("f-source"),
  iteration: document.getElementById("f-iteration"), kernel: document.getElementById("f-kernel"),
  split: document.getElementById("f-split"), role: document.getElementById("f-role"),
  min: document.getElementById("f-min"), max: document.getElementById("f-max"),
  invalid: document.getElementById("f-invalid"),
};

function fillSelect(select, values) {
  for (const value of values) select.append(el("option", {value: String(value), text: String(value)}));
}

// The seats an outcome filter reads: those of the chosen role, else the trained seats (all seats when none was).
function seatsOf(episode, role) {
  if (role) return episode.seats.filter(s => s.role === role);
  const trained = episode.seats.filter(s => s.trainable);
  return trained.length ? trained : episode.seats;
}

function result(episode, seat) {
  return episode.results[seat.name] || {};
}

function scoredOutcome(episode, role) {
  const outcomes = seatsOf(episode, role).map(s => result(episode, s).outcome).filter(Number.isFinite);
  if (!outcomes.length) return null;
  return outcomes.reduce((sum, o) => sum + o, 0) / outcomes.length;
}

function visibleEpisodes() {
  const iteration = filters.iteration.value, kernel = filters.kernel.value.trim(), split = filters.split.value;
  const role = filters.role.value, source = filters.source.value;
  const lo = filters.min.value === "" ? -Infinity : Number(filters.min.value);
  const hi = filters.max.value === "" ? Infinity : Number(filters.max.value);
  return DATA.episodes.filter(ep => {
    if (source && ep.source !== source) return false;
    if (iteration !== "" && String(ep.iteration) !== iteration) return false;
    if (kernel && !ep.kernel.includes(kernel)) return false;
    if (split && ep.split !== split) return false;
    if (role && !ep.seats.some(s => s.role === role)) return false;
    if (filters.invalid.checked && !ep.turns.some(t => t.invalid)) return false;
    const outcome = scoredOutcome(ep, role);
    return outcome === null ? lo === -Infinity && hi === Infinity : outcome >= lo && outcome <= hi;
  });
}

function renderEpisodes() {
  const shown = visibleEpisodes();
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  state.page = Math.min(state.page, pages - 1);
  const sampled = DATA.episodes.length < DATA.episodes_total
    ? ` (a sample of ${DATA.episodes.length} of the run's ${DATA.episodes_total}, evenly across iterations)` : "";
  const finals = DATA.episodes.filter(ep => ep.source === "final").length;
  const held = finals ? `, ${finals} of them from the final held-out evaluation` : "";
  const credited = shown.reduce((n, ep) => n + ep.turns.filter(t => t.advantage !== null).length, 0);
  document.getElementById("episode-count").textContent =
    `${shown.length} of ${DATA.episodes.length} episodes${sampled}${held}; ${credited} of their turns carry the estimator's credit.`;
  const body = document.querySelector("#episode-table tbody");
  body.replaceChildren(...shown.slice(state.page * PAGE_SIZE, (state.page + 1) * PAGE_SIZE).map(ep => {
    const row = el("tr", {"data-episode": ep.id, class: ep.id === state.selected ? "selected" : "",
      onclick: () => { state.selected = ep.id; state.seat = null; renderEpisodes(); }},
      el("td", {class: "num"}, String(ep.iteration), ep.source === "final" ? el("span", {class: "badge final", text: "final, held-out"}) : null),
      el("td", {text: ep.id}), el("td", {text: ep.kernel}),
      el("td", {text: ep.split}),
      el("td", {text: ep.seats.map(s => `${s.name} (${s.role}) = ${s.agent}${s.trainable ? " *" : ""}`).join(", ")}),
      el("td", {text: ep.seats.map(s => `${s.name} ${num(result(ep, s).outcome, 2)}`).join(", ")}),
      el("td", {text: ep.end}));
    return row;
  }));
  const pager = document.getElementById("pager");
  pager.replaceChildren();
  if (pages > 1) {
    for (let p = 0; p < pages; p++) {
      const attrs = {type: "button", text: String(p + 1), onclick: () => { state.page = p; renderEpisodes(); }};
      if (p === state.page) attrs["aria-current"] = "page";
      pager.append(el("button", attrs));
    }
  }
  renderDetail(DATA.episodes.find(ep => ep.id === state.selected));
}

function channelBadge(channel) {
  return channel ? el("span", {class: `badge ${channel}`, text: channel}) : null;
}

function seenMessage(message) {
  const classes = `msg ${message.role}${message.channel ? " ch-" + message.channel : ""}`;
  if (message.role === "system") {
    return el("details", {class: classes}, el("summary", {text: "rules and private information (system prompt)"}),
      el("div", {text: message.content}));
  }
  return el("div", {class: classes}, channelBadge(message.channel), message.content);
}

function creditBadges(turn) {
  const out = [el("span", {class: "badge", text: `reward ${num(turn.reward)}`})];
  if (turn.advantage !== null) {
    out.push(el("span", {class: `badge credit ${turn.advantage >= 0 ? "pos" : "neg"}`, text: `advantage ${signed(turn.advantage)}`}));
  }
  if (turn.return !== null) out.push(el("span", {class: "badge credit", text: `return ${num(turn.return)}`}));
  if (turn.finish === "length") out.push(el("span", {class: "badge", text: "cut at max tokens"}));
  return out;
}

function wroteMessage(turn, who) {
  const header = el("div", {}, el("strong", {text: `${who} wrote (turn ${turn.index + 1}${turn.round ? `, round ${turn.round}` : ""}) `}),
    ...creditBadges(turn));
  const box = el("div", {class: `msg wrote${turn.invalid ? " invalid" : ""}`, "data-turn": String(turn.step)}, header, turn.text);
  if (turn.invalid) box.append(el("div", {}, el("span", {class: "badge bad", text: "invalid"}), turn.error || "invalid action"));
  else if (turn.action) box.append(el("div", {class: "muted", text: `action: ${turn.action}`}));
  return box;
}

function seatTranscript(ep, seat) {
  const box = el("div", {class: "transcript", "data-seat": seat.name});
  for (const turn of ep.turns.filter(t => t.seat === seat.name)) {
    for (const message of turn.seen) box.append(seenMessage(message));
    box.append(wroteMessage(turn, seat.name));
  }
  for (const message of ep.final[seat.name] || []) box.append(seenMessage(message));
  return box;
}

function timeline(ep) {
  return el("div", {class: "transcript"}, ...ep.turns.map(turn => wroteMessage(turn, turn.seat)));
}

function renderDetail(ep) {
  const box = document.getElementById("episode-detail");
  box.replaceChildren();
  if (!ep) return;
  const results = el("table", {class: "grid"},
    el("thead", {}, el("tr", {}, ...["seat", "role", "agent", "trained", "points", "outcome", "turns", "invalid"].map(h => el("th", {text: h})))),
    el("tbody", {}, ...ep.seats.map(s => {
      const r = result(ep, s);
      return el("tr", {}, el("td", {text: s.name}), el("td", {text: s.role}), el("td", {text: s.agent}),
        el("td", {text: s.trainable ? "yes" : "no"}), el("td", {class: "num", text: num(r.points)}),
        el("td", {class: "num", text: num(r.outcome)}), el("td", {class: "num", text: num(r.turns)}),
        el("td", {class: "num", text: num(r.invalid)}));
    })));
  const metrics = Object.entries(ep.metrics).map(([k, v]) => `${k} ${num(v)}`).join(" · ");
  const views = [...ep.seats.map(s => [s.name, () => seatTranscript(ep, s)]), ["All turns", () => timeline(ep)]];
  const current = views.find(([name]) => name === state.seat) || views[0];
  const tabs = el("div", {class: "tabs", role: "tablist"}, ...views.map(([name]) => el("button", {
    type: "button", role: "tab", "aria-selected": String(name === current[0]),
    text: name === "All turns" ? name : `${name} sees`, onclick: () => { state.seat = name; renderDetail(ep); }})));
  box.append(el("div", {class: "detail", id: "detail-panel"},
    el("h3", {text: `${ep.id} · kernel ${ep.kernel} (${ep.split}) · ended: ${ep.end}` +
      (ep.source === "final" ? " · the final held-out evaluation: the trained policy after the last update" : "")}),
    results,
    el("p", {class: "muted", text: metrics}), tabs, current[1]()));
}

function setupFilters() {
  fillSelect(filters.iteration, [...new Set(DATA.episodes.map(ep => ep.iteration))].sort((a, b) => a - b));
  fillSelect(filters.split, [...new Set(DATA.episodes.map(ep => ep.split))].sort());
  fillSelect(filters.role, [...new Set(DATA.episodes.flatMap(ep => ep.seats.map(s => s.role)))].sort());
  const kernels = document.getElementById("kernel-list");
  for (const kernel of [...new Set(DATA.episodes.map(ep => ep.kernel))].sort()) kernels.append(el("option", {value: kernel}));
  const form = document.getElementById("filters");
  form.addEventListener("input", () => { state.page = 0; renderEpisodes(); });
  form.addEventListener("submit", event => event.preventDefault());
  form.addEventListener("reset", () => setTimeout(() => { state.page = 0; renderEpisodes(); }, 0));
}

document.getElementById("run-title").textContent = `repertory · ${DATA.run}`;
document.getElementById("run-summary").textContent =
  `${DATA.episodes_total} episodes, ${DATA.figures.length} figures · page written ${DATA.generated}`;
for (const warning of DATA.warnings) document.getElementById("warnings").append(el("li", {text: warning}));
document.getElementById("config-text").textContent = DATA.config || "(no config.yaml)";
renderHeadline();
renderBehaviour();
renderCurves();
renderEvaluations();
setupFilters();
renderEpisodes();
