"""`rlhf report OUTPUT_DIR`: one self-contained HTML page of a run, finished or still going.

The page reads only what the run writes (config.yaml, metrics.jsonl, samples.jsonl,
trace/step_*.json) and draws everything itself: curves and timelines are inline SVG, the
search boxes a few lines of inline script, so it opens offline. Sections: the config, metric
curves, time per step (the driver's phases) and per role (the ranks' spans of traced steps),
memory per phase against `rlhf plan`'s prediction, the sample tables, and the timeline of the
last traced steps with links to their Perfetto files. A script error is written into the
page's #errors element, which a browser test reads.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from rlhf.errors import RLHFError
from rlhf.trace import TRACE_DIR
from rlhf.trainer.loggers import REPORT_FILE

TIMELINES_SHOWN = 3  # the newest traced steps drawn inline; every one is linked
ROLE_STEPS_SHOWN = 5  # the newest traced steps in the per-role table, newest first
MAX_SPANS_DRAWN = 4000  # per timeline: a page stays light on runs with many micro-batches
SECTIONS = ("config", "curves", "time", "roles", "memory", "samples", "timeline")
# One colour per role (and the driver), in order of first appearance.
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")


def add_command(commands: argparse._SubParsersAction) -> None:
    """Register `report` on the top-level subparsers."""
    parser = commands.add_parser(
        "report", help="write one self-contained HTML page of a run (config, curves, time per "
                       "step and role, memory against the plan, samples, timeline); works "
                       "while the run goes on")
    parser.add_argument("output_dir", help="the run's trainer.output_dir")
    parser.add_argument("-o", "--out", default=None,
                        help=f"the page to write (default OUTPUT_DIR/{REPORT_FILE}; the "
                             "timeline links are relative to OUTPUT_DIR)")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    out = write_report(args.output_dir, out=args.out)
    print(f"wrote {out}")
    return 0


def write_report(output_dir: str | Path, *, out: str | Path | None = None) -> Path:
    """Build the page of run folder `output_dir` and write it (default OUTPUT_DIR/report.html)."""
    run = Path(output_dir)
    path = Path(out) if out else run / REPORT_FILE
    page = build_report(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def build_report(run: Path, *, only: tuple[str, ...] = SECTIONS) -> str:
    """The HTML of run folder `run` (see the module docstring); `only`: these sections."""
    from rlhf.trainer.loggers import METRICS_FILE, SAMPLES_FILE, read_jsonl

    config_file = run / "config.yaml"
    if not config_file.is_file():
        raise RLHFError(f"{run} holds no config.yaml: give the trainer.output_dir of a run that "
                        "started (`rlhf train` writes it before the first step)")
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown report sections {unknown}; choose from {', '.join(SECTIONS)}")
    records = [r for r in read_jsonl(run / METRICS_FILE, growing=True) if isinstance(r.get("step"), int)]
    samples = read_jsonl(run / SAMPLES_FILE, growing=True)
    traces = sorted((run / TRACE_DIR).glob("step_*.json"))
    total = _total_steps(run)
    done = max((r["step"] for r in records), default=0)
    state = "finished" if total is not None and done >= total else "running or stopped"
    title = f"rlhf run {run.resolve().name}"
    nav = " ".join(f'<a href="#{s}">{s}</a>' for s in only)
    sections = {
        "config": ("Config", lambda: f"<pre>{_e(config_file.read_text(encoding='utf-8'))}</pre>"),
        "curves": ("Metric curves", lambda: _curves(records)),
        "time": ("Time per step (driver phases, s)", lambda: _time_per_step(records, traces)),
        "roles": (f"Time per role and rank (the newest {ROLE_STEPS_SHOWN} traced steps)",
                  lambda: _roles(traces)),
        "memory": ("Memory per phase against the plan", lambda: _memory(run, records)),
        "samples": ("Samples", lambda: _samples(samples)),
        "timeline": ("Timeline", lambda: _timelines(traces)),
    }
    body = [
        f"<header><h1>{_e(title)}</h1><p>{_e(str(run.resolve()))}: step {done} of "
        f"{total if total is not None else '?'} ({state}); {len(traces)} traced steps, "
        f"{len({s['step'] for s in samples})} sample tables</p>"
        f"<nav>{nav}</nav></header>",
        '<div id="errors"></div>',
        *[_section(name, sections[name][0], sections[name][1]()) for name in only],
    ]
    return PAGE.format(title=_e(title), style=STYLE, body="\n".join(body), script=SCRIPT)


def _total_steps(run: Path) -> int | None:
    from rlhf.config import load_config

    try:
        return load_config(run / "config.yaml").trainer.total_steps
    except Exception:  # noqa: BLE001 - a config this version cannot read still gets a page
        return None


# Control characters (sampled text holds any token) are shown as \xNN, not put in the page raw.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(32), 127] if chr(c) not in "\n\t"}


def _e(value: Any) -> str:
    return html.escape(str(value).translate(_CONTROLS), quote=True)


def _section(anchor: str, title: str, content: str) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{content}</section>'


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


# ---- curves ------------------------------------------------------------------------------------


def _numbers(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
            and math.isfinite(r[key])]


def _curves(records: list[dict]) -> str:
    from rlhf.trainer.loggers import HEADLINE_METRICS

    found = {k for r in records for k, v in r.items()
             if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    first = [k for k, _ in HEADLINE_METRICS if k in found] + ["timing/step"] * (
        "timing/step" in found)
    keys = first + sorted(found - set(first))  # the progress bar's metrics lead
    if not keys:
        return _note("no metrics yet (metrics.jsonl is empty or absent)")
    charts = [f'<figure class="chart" data-name="{_e(k)}">{_line_chart(_numbers(records, k))}'
              f"<figcaption>{_e(k)}</figcaption></figure>" for k in keys]
    return ('<input class="search" data-target="curves" placeholder="filter metrics, e.g. '
            'reward/ or timing/">' + f'<div class="grid">{"".join(charts)}</div>')


def _line_chart(points: list[tuple[int, float]], width: int = 260, height: int = 110) -> str:
    if not points:
        return "<svg></svg>"
    pad = 30
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    sx = (width - pad - 5) / (x1 - x0 or 1)
    sy = (height - 25) / (y1 - y0 or 1)
    at = [(pad + (x - x0) * sx, height - 15 - (y - y0) * sy) for x, y in points]
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in at)
    dots = "".join(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2"><title>step {s}: {v:.6g}'
                   f"</title></circle>" for (x, y), (s, v) in zip(at, points)) \
        if len(points) <= 60 else ""
    return (f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
            f'<text x="2" y="12" class="axis">{y1:.4g}</text>'
            f'<text x="2" y="{height - 15}" class="axis">{y0:.4g}</text>'
            f'<text x="{pad}" y="{height - 2}" class="axis">{x0}</text>'
            f'<text x="{width - 5}" y="{height - 2}" class="axis" text-anchor="end">{x1}</text>'
            f'<polyline points="{path}" fill="none" stroke="#4e79a7"/>{dots}</svg>')


# ---- time --------------------------------------------------------------------------------------

# Driver sections that are not phases of the training step: `step` holds them all; validation
# and taking the timeline run after it.
_TOTALS = ("timing/step", "timing/validate", "timing/trace")


def _time_per_step(records: list[dict], traces: list[Path]) -> str:
    train = [r for r in records if "timing/step" in r]
    if not train:
        return _note("no training step logged yet")
    phases = [k for k in dict.fromkeys(k for r in train for k in r)
              if k.startswith("timing/") and k not in _TOTALS
              and not k.startswith("timing/pin_s")]
    colours = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(phases)}
    traced = {_trace_step(p) for p in traces}
    width, height, bar = 900, 220, max(2.0, min(30.0, 860 / len(train)))
    top = max(r["timing/step"] for r in train) or 1.0
    rects = []
    for i, r in enumerate(train):
        x, y = 40 + i * bar, height - 20
        for p in phases:
            h = (r.get(p) or 0.0) / top * (height - 40)
            if h > 0:
                rects.append(f'<rect x="{x:.1f}" y="{y - h:.1f}" width="{bar * 0.85:.1f}" '
                             f'height="{h:.1f}" fill="{colours[p]}"><title>step {r["step"]} '
                             f'{_e(p)}: {r[p]:.3f} s</title></rect>')
                y -= h
    legend = "".join(f'<span class="key" style="background:{c}"></span>{_e(p[7:])} '
                     for p, c in colours.items())
    rows = [["step", "total s", *[p[7:] for p in phases], "timeline"]]
    for r in train:
        link = (f'<a href="#timeline-step-{r["step"]}">step {r["step"]}</a>'
                if r["step"] in traced else "")
        rows.append([str(r["step"]), f'{r["timing/step"]:.3f}',
                     *[f"{r[p]:.3f}" if p in r else "" for p in phases], link])
    svg = (f'<svg width="{width}" height="{height}"><text x="2" y="14" class="axis">'
           f"{top:.3g} s</text>{''.join(rects)}</svg>")
    return f"{svg}<p>{legend}</p>{_table(rows, raw_last=True)}"


def _trace_step(path: Path) -> int:
    return int(path.stem.removeprefix("step_"))


def _roles(traces: list[Path]) -> str:
    if not traces:
        return _note("no traced step yet (trainer.trace)")
    rows = [["step", "role", "method", "ranks", "slowest rank s", "fastest rank s", "spread"]]
    for path in reversed(traces[-ROLE_STEPS_SHOWN:]):
        trace = json.loads(path.read_text(encoding="utf-8"))
        names = _process_names(trace)
        per: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for ev in trace["traceEvents"]:
            if ev.get("ph") == "X" and ev["args"].get("role_method"):
                per[(ev["args"]["role"], ev["name"])][names[ev["pid"]]] += ev["dur"] / 1e6
        for (role, method), ranks in sorted(per.items()):
            slow, fast = max(ranks.values()), min(ranks.values())
            slowest = max(ranks, key=ranks.__getitem__)
            rows.append([f'<a href="#timeline-step-{_trace_step(path)}">{_trace_step(path)}</a>',
                         _e(role), _e(method), str(len(ranks)), f"{slow:.3f} ({_e(slowest)})",
                         f"{fast:.3f}", f"{(slow - fast) / slow:.0%}" if slow else "0%"])
    return _table(rows, escaped=True)


def _process_names(trace: dict) -> dict[int, str]:
    return {ev["pid"]: ev["args"]["name"] for ev in trace["traceEvents"]
            if ev.get("ph") == "M" and ev["name"] == "process_name"}


# ---- memory ------------------------------------------------------------------------------------


def _memory(run: Path, records: list[dict]) -> str:
    from rlhf.plan.memory import METHOD_PHASES

    planned, note = _plan(run)
    rows = [["method", "plan phase", "plan GiB (fullest device)", "allocated GiB (max)",
             "reserved GiB (max)", "free GiB (min)", "host RSS GiB (max)"]]
    for method, phase in METHOD_PHASES.items():
        stats: dict[str, list[float]] = defaultdict(list)
        for r in records:
            for k, v in r.items():
                if k.startswith(f"memory/{method}/") and isinstance(v, float):
                    stats[k.rsplit("/", 1)[1]].append(v)
        if not stats:
            continue
        rows.append([method, phase, f"{planned[phase]:.3f}" if phase in planned else "",
                     *[f"{fn(stats[name]):.3f}" if stats.get(name) else ""
                       for name, fn in (("allocated_gb", max), ("reserved_gb", max),
                                        ("free_gb", min), ("host_rss_gb", max))]])
    head = _note(note) if note else ""
    if len(rows) == 1:
        return head + _note("no memory measured yet (memory/<method>/* metrics)")
    return head + _table(rows)


def _plan(run: Path) -> tuple[dict[str, float], str]:
    """{phase: planned GiB} of the run's config, or ({}, why there is none)."""
    try:
        from rlhf.config import load_config
        from rlhf.plan.memory import phase_peaks_gib, plan_job

        plan = plan_job(load_config(run / "config.yaml"))
    except Exception as e:  # noqa: BLE001 - the page goes on without a plan, saying why
        return {}, f"no plan: {type(e).__name__}: {e}"
    kind = plan.hardware.device_type
    note = ("" if kind == "cuda" else "planned for the CPU: the plan counts the state a device "
            "would hold; host RSS also holds Python, torch and vLLM themselves")
    return phase_peaks_gib(plan), note


# ---- samples -----------------------------------------------------------------------------------


def _samples(samples: list[dict]) -> str:
    from rlhf.trainer.loggers import table_columns

    if not samples:
        return _note("no sample table yet (trainer.samples_every)")
    columns = table_columns(samples)
    rows = [columns] + [[_cell(s.get(c)) for c in columns] for s in samples]
    return ('<input class="search" data-target="samples" placeholder="search prompts, '
            'responses, steps, worst / best">' + _table(rows, cls="samples"))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _table(rows: list[list[str]], *, cls: str = "", escaped: bool = False,
           raw_last: bool = False) -> str:
    """rows[0] is the header; cells are escaped unless `escaped` (or, with `raw_last`, the
    last column) holds HTML already."""
    def cell(text: str, raw: bool) -> str:
        return text if raw else _e(text)

    head = "".join(f"<th>{_e(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(c, escaped or (raw_last and j == len(r) - 1))}</td>"
                         for j, c in enumerate(r)) + "</tr>" for r in rows[1:])
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# ---- timeline ----------------------------------------------------------------------------------


def _timelines(traces: list[Path]) -> str:
    if not traces:
        return _note("no traced step yet: trainer.trace (every_n, steps) records them")
    links = " ".join(f'<a href="{TRACE_DIR}/{p.name}">{_trace_step(p)}</a>' for p in traces)
    parts = [f"<p>Perfetto / Chrome trace files (open in ui.perfetto.dev or chrome://tracing): "
             f"{links}</p>"]
    shown = [(p, json.loads(p.read_text(encoding="utf-8"))) for p in traces[-TIMELINES_SHOWN:]]
    # one colour per role on the whole page: the driver first, then the roles by name
    roles = sorted({ev["cat"] for _, t in shown for ev in t["traceEvents"] if ev.get("ph") == "X"},
                   key=lambda r: (r != "driver", r))
    colour = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(roles)}
    for path, trace in shown:
        parts.append(_timeline_svg(trace, step=_trace_step(path), colour=colour,
                                   href=f"{TRACE_DIR}/{path.name}"))
    return "".join(parts)


def _timeline_svg(trace: dict, *, step: int, colour: dict[str, str], href: str) -> str:
    """One traced step: a track per process and thread, nested spans stacked, coloured by role."""
    names = _process_names(trace)
    spans = sorted((ev for ev in trace["traceEvents"] if ev.get("ph") == "X"),
                   key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev["dur"]))
    dropped = max(0, len(spans) - MAX_SPANS_DRAWN)
    if dropped:  # keep the longest: they carry the step's time
        spans = sorted(sorted(spans, key=lambda ev: -ev["dur"])[:MAX_SPANS_DRAWN],
                       key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev["dur"]))
    end = max((ev["ts"] + ev["dur"] for ev in spans), default=1) or 1
    width, left, row_h = 1100, 150, 14
    scale = (width - left - 10) / end
    rects, labels, y = [], [], 20
    tracks: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for ev in spans:
        tracks[(ev["pid"], ev["tid"])].append(ev)
    for (pid, tid), evs in tracks.items():
        depths, stack = [], []  # open spans' end times: a span inside another goes one deeper
        for ev in evs:
            while stack and stack[-1] <= ev["ts"]:
                stack.pop()
            depths.append(len(stack))
            stack.append(ev["ts"] + ev["dur"])
        rows = max(depths) + 1
        labels.append(f'<text x="2" y="{y + 11}" class="axis">{_e(names.get(pid, pid))}'
                      f'{f" t{tid}" if tid else ""}</text>')
        for ev, depth in zip(evs, depths):
            x, w = left + ev["ts"] * scale, max(ev["dur"] * scale, 0.5)
            args = ", ".join(f"{k}={v}" for k, v in ev["args"].items() if k not in ("step",))
            rects.append(f'<rect x="{x:.1f}" y="{y + depth * row_h}" width="{w:.1f}" '
                         f'height="{row_h - 2}" fill="{colour[ev["cat"]]}"><title>'
                         f'{_e(ev["name"])} {ev["dur"] / 1e3:.2f} ms ({_e(args)})</title></rect>')
            if w > 40:
                rects.append(f'<text x="{x + 2:.1f}" y="{y + depth * row_h + 10}" '
                             f'class="span">{_e(ev["name"])[: int(w / 6)]}</text>')
        y += rows * row_h + 6
    drawn = {ev["cat"] for ev in spans}
    legend = "".join(f'<span class="key" style="background:{c}"></span>{_e(r)} '
                     for r, c in colour.items() if r in drawn)
    more = f" ({dropped} shortest spans not drawn)" if dropped else ""
    return (f'<div class="timeline" id="timeline-step-{step}"><h3>step {step}: '
            f'{end / 1e6:.3f} s <a href="{_e(href)}">trace file</a>{more}</h3><p>{legend}</p>'
            f'<svg width="{width}" height="{y + 5}"><line x1="{left}" x2="{left}" y1="0" '
            f'y2="{y}" stroke="#999"/>{"".join(labels)}{"".join(rects)}</svg></div>')


# ---- page --------------------------------------------------------------------------------------

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head>
<body>
{body}
<script>{script}</script>
</body></html>
"""

STYLE = """
body { font: 13px system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; border-bottom: 1px solid #ccc; }
h3 { font-size: 13px; } nav a { margin-right: 10px; }
pre { background: #f6f6f6; padding: 8px; max-height: 320px; overflow: auto; }
table { border-collapse: collapse; margin: 6px 0; }
td, th { border: 1px solid #ddd; padding: 2px 6px; vertical-align: top; text-align: left; }
table.samples td { max-width: 420px; white-space: pre-wrap; overflow-wrap: break-word; }
.grid { display: flex; flex-wrap: wrap; gap: 6px; }
figure.chart { margin: 0; border: 1px solid #eee; } figcaption { font-size: 11px; padding: 0 4px; }
.axis { font-size: 9px; fill: #666; } .span { font-size: 9px; fill: #fff; pointer-events: none; }
.key { display: inline-block; width: 10px; height: 10px; margin: 0 3px 0 8px; }
.note { color: #666; } .search { width: 360px; margin: 4px 0; padding: 3px; }
#errors:not(:empty) { background: #fdd; padding: 6px; }
"""

# Filters (a box hides the charts or table rows of its section that do not contain its text);
# any error is written into #errors, and body[data-ready] marks that the script ran to its end.
SCRIPT = """
window.onerror = function (msg, src, line) {
  document.getElementById("errors").textContent += "script error: " + msg + " (line " + line + ")\\n";
};
document.querySelectorAll("input.search").forEach(function (box) {
  var section = document.getElementById(box.dataset.target);
  box.addEventListener("input", function () {
    var want = box.value.toLowerCase();
    section.querySelectorAll("figure.chart, tbody tr").forEach(function (item) {
      item.style.display = item.textContent.toLowerCase().indexOf(want) >= 0 ? "" : "none";
    });
  });
});
document.body.dataset.ready = "1";
"""
