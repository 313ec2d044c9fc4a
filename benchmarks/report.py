"""Writing the results: a Markdown table (no extra dependency) and a PNG plot (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

from ._common import Row, spread


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.01:
        return f"{x:.3g}" if a < 1 else f"{x:.2f}"
    return f"{x:.2g}"


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(samples: list[float]) -> tuple[str, str]:
    med, p10, p90 = spread(samples)
    return _num(med), f"{_num(p10)}-{_num(p90)}"


def _per_workload(
    meta: dict[str, object], key: str, heading: str, show: Callable[[list[str]], str]
) -> list[str]:
    """One line of the machine's section: ``meta[key]`` (a figure per workload) as ``heading: name
    figure; ...``, or none when the run did not record it."""
    values = meta.get(key)
    if not isinstance(values, dict) or not values:
        return []
    return [f"- {heading}: " + "; ".join(f"{name} {show(value)}" for name, value in values.items())]


def markdown(rows: list[Row], meta: dict[str, object]) -> str:
    """The results page: machine, table, notes."""
    machine = meta["machine"]
    assert isinstance(machine, dict)
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{meta['command']}` ({meta['mode']} mode), {meta['started']}, took {meta['duration']}.",
        "",
        "Every ratio is the variant's figure divided by its baseline's, each pair measured side by side in "
        "the same run (interleaved rounds or the same repeat), so the machine's speed and load largely "
        "cancel out. Median and p10-p90 over the repeats (over blocks of rounds for spawn). Lower is "
        "better for times; for throughput and speed-up rows higher is better. Absolute figures are "
        "context only.",
        "",
        "## Machine",
        "",
    ]
    for key, value in machine.items():
        lines.append(f"- {key}: {value}")
    lines += [
        f"- load average (1, 5, 15 min) at start: {meta['load_start']}; at end: {meta['load_end']}",
    ]
    lines += _per_workload(
        meta,
        "workload_loads",
        "load average per workload (start -> end)",
        lambda pair: f"{pair[0]} -> {pair[1]}",
    )
    lines += _per_workload(
        meta,
        "workload_files",
        "a file allocation in the scratch directory per workload, in us (start -> end; seconds waited for "
        "<= 50 us first)",
        lambda f: f"{f[0]} -> {f[1]} ({f[2]} s)",
    )
    lines += _per_workload(
        meta,
        "workload_cpu_probe",
        "the CPU probe per workload (a fixed sum in pure Python, median of five, in ms; start -> end: the "
        "same code takes longer when the host runs this VM slower)",
        lambda c: f"{c[0]} -> {c[1]}",
    )
    lines += [
        "",
        "## Results",
        "",
        "`containment` is the engine's mode for the row (`cgroup`: a cgroup v2 leaf per run; "
        "`process-group`: process groups, `/proc` links and the run marker); rows without one do not "
        "depend on it. `met` is `floor` where the target is below what the machine allows: the measured "
        "floor of each step is in [analysis.md](analysis.md).",
        "",
        "| workload | variant | containment | median | p10-p90 | unit | vs | ratio | ratio p10-p90 | target "
        "| met | n |",
        "|---|---|---|---:|---:|---|---|---:|---:|---|---|---:|",
    ]
    baselines = {(r.workload, r.baseline) for r in rows if r.baseline}
    for r in rows:
        med, rng = _cell(r.values)
        if r.ratios:
            rmed, rrng = _cell(r.ratios)
            rmed += "x"
        else:
            rmed, rrng = ("baseline" if (r.workload, r.variant) in baselines else "-"), ""
        met = "floor" if r.floor else {True: "yes", False: "**no**", None: ""}[r.met]
        vs = _esc(r.baseline or "")
        lines.append(
            f"| {r.workload} | {_esc(r.variant)} | {r.mode} | {med} | {rng} | {r.unit} | {vs} | {rmed} | "
            f"{rrng} | {r.target} | {met} | {len(r.values)} |"
        )
    notes = [r for r in rows if r.note]
    if notes:
        lines += ["", "## Row notes", ""]
        for r in notes:
            mode = f" ({r.mode})" if r.mode else ""
            lines.append(f"- {r.workload} / {_esc(r.variant)}{mode}: {r.note}")
    extra = meta.get("notes")
    if isinstance(extra, list) and extra:
        lines += ["", "## Run notes", ""]
        lines += [f"- {n}" for n in extra]
    lines.append("")
    return "\n".join(lines)


def write_json(rows: list[Row], meta: dict[str, object], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.to_dict() for r in rows]}, f, indent=1)


def plot(rows: list[Row], path: str, title: str) -> None:
    """Horizontal bars of every ratio (median, p10-p90 whiskers) on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.ratios]
    labels = [
        f"{r.workload}: {r.variant}{f' [{r.mode}]' if r.mode else ''}\n(vs {r.baseline})" for r in shown
    ]
    meds, lo, hi = [], [], []
    for r in shown:
        med, p10, p90 = spread(r.ratios)
        meds.append(med)
        lo.append(max(med - p10, 0.0))
        hi.append(max(p90 - med, 0.0))
    height = max(3.0, 0.42 * len(shown) + 1.2)
    fig, ax = plt.subplots(figsize=(11, height))
    ys = list(range(len(shown)))[::-1]
    colors = ["#4c72b0" if "supervisord" not in r.variant else "#dd8452" for r in shown]
    ax.barh(ys, meds, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio to the baseline named in brackets (median, p10-p90), log scale")
    ax.set_title(title, fontsize=10)
    for y, m in zip(ys, meds, strict=True):
        ax.text(m, y, f" {m:.3g}x", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_all(rows: list[Row], meta: dict[str, object], out_dir: str, *, with_plot: bool) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "results.md")
    with open(md, "w") as f:
        f.write(markdown(rows, meta))
    js = os.path.join(out_dir, "results.json")
    write_json(rows, meta, js)
    written = [md, js]
    if with_plot:
        png = os.path.join(out_dir, "results.png")
        plot(rows, png, f"gadget-engine benchmarks ({meta['mode']}), {meta['started']}")
        written.append(png)
    return written
