"""PNG figures of a run's curves, drawn from the stage manifests (hpcrl.inspection.iteration_table).

    reward.png           train reward mean and validation score per iteration
    kl_clipfrac.png      policy KL (and the KL penalty to the reference) and the clip fraction
    response_length.png  mean and longest response, with the max_tokens limit
    stage_timings.png    stacked wall time of generate, score and update per iteration
    timeline.png         each stage of the last iterations from its opening to its commit, one lane
                         per role: what ran beside what (asynchronous generation, scores beside it)

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend state), so the
controller can call `write_plots` in its own process.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hpcrl import commit, utilisation
from hpcrl.config import Experiment
from hpcrl.inspection import InspectError, iteration_table
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import GENERATE, ORDER, SCORE, UPDATE

EXTRA = ("response_length/max",)
TIMELINE_ITERATIONS = 12  # the last iterations timeline.png shows
STAGE_COLOURS = {GENERATE: "#4C72B0", SCORE: "#DD8452", UPDATE: "#55A868"}


def _series(df: pl.DataFrame, key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) where the metric is present."""
    part = df.select("iteration", key).drop_nulls()
    return part["iteration"].to_list(), part[key].to_list()


def _line(ax: Axes, df: pl.DataFrame, key: str, label: str, **style) -> bool:
    x, y = _series(df, key)
    if not x:
        return False
    ax.plot(x, y, label=label, marker="o" if len(x) <= 60 else None, markersize=3.5, linewidth=1.6, **style)
    return True


def _finish(fig: Figure, ax: Axes, title: str, ylabel: str, drawn: bool, empty: str,
            legend_loc: str = "best") -> None:
    ax.set_title(title)
    if ax.get_subplotspec().is_last_row():
        ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if drawn:
        ax.legend(loc=legend_loc, fontsize=9, ncols=3 if legend_loc == "upper center" else 1)
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="grey")


def _figure(nrows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(9, 4.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def reward_figure(df: pl.DataFrame, run_name: str) -> Figure:
    fig, (ax,) = _figure()
    drawn = _line(ax, df, "critic/score/mean", "train reward (mean over samples)", color="#4C72B0")
    drawn |= _line(ax, df, "val/score", "validation score (greedy, mean)", color="#C44E52", linestyle="--")
    _finish(fig, ax, f"{run_name}: reward per iteration", "reward (mean per sample)", drawn,
            "no scored iteration yet")
    return fig


def kl_figure(df: pl.DataFrame, run_name: str) -> Figure:
    fig, (top, bottom) = _figure(2)
    drawn = _line(top, df, "actor/ppo_kl", "KL(old policy || new policy), actor/ppo_kl", color="#8172B2")
    if "actor/kl_loss" in df.columns:
        drawn |= _line(top, df, "actor/kl_loss", "KL to the reference policy, actor/kl_loss", color="#937860")
    top.axhline(0, color="black", linewidth=0.6)
    _finish(fig, top, f"{run_name}: policy KL per update", "KL (nats per token)", drawn,
            "no committed update yet")
    drawn = _line(bottom, df, "actor/pg_clipfrac", "clipped fraction, actor/pg_clipfrac", color="#DA8BC3")
    _finish(fig, bottom, "PPO clip fraction", "fraction of tokens clipped", drawn, "no committed update yet")
    return fig


def length_figure(df: pl.DataFrame, run_name: str, max_tokens: int) -> Figure:
    fig, (ax,) = _figure()
    drawn = _line(ax, df, "response_length/mean", "mean response length", color="#4C72B0")
    drawn |= _line(ax, df, "response_length/max", "longest response", color="#64B5CD", linestyle=":")
    if drawn:
        ax.axhline(max_tokens, color="#C44E52", linewidth=1, linestyle="--",
                   label=f"generate.max_tokens = {max_tokens}")
    ax.set_ylim(bottom=0)
    _finish(fig, ax, f"{run_name}: response length of training samples", "length (tokens)", drawn,
            "no generated iteration yet")
    return fig


def timing_figure(df: pl.DataFrame, run_name: str) -> Figure:
    fig, (ax,) = _figure()
    x = df["iteration"].to_list()
    bottom = [0.0] * len(x)
    for stage in ORDER:
        values = [v or 0.0 for v in df[f"timing_s/{stage}"].to_list()]
        if any(values):
            ax.bar(x, values, bottom=bottom, width=0.8, label=stage, color=STAGE_COLOURS[stage])
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylim(0, max(bottom, default=0) * 1.2 or 1)  # room for the legend above the bars
    _finish(fig, ax, f"{run_name}: wall time of each stage job per iteration", "wall time (s)", any(bottom),
            "no committed stage yet", legend_loc="upper center")
    return fig


def stage_spans(run: RunDir, last: int = TIMELINE_ITERATIONS) -> list[tuple[str, str, int, float, float]]:
    """(lane, stage, iteration, opened_at, committed_at) of each committed stage of the `last`
    iterations whose manifest records its opening; the lane is the role that ran it ("<role>,
    beside" for a stage on a thread beside the role's others)."""
    out = []
    for k in sorted(run.iterations_present())[-last:]:
        for stage in ORDER:
            if not commit.is_committed(run.stage_dir(k, stage)):
                continue
            m = commit.read_manifest(run.stage_dir(k, stage))
            use = m.get("utilisation") or {}
            if "opened_at" in m:
                lane = use.get("role", stage) + (", beside" if use.get("beside") else "")
                out.append((lane, stage, k, m["opened_at"], m["committed_at"]))
    return out


def timeline_figure(spans: list[tuple[str, str, int, float, float]], run_name: str) -> Figure:
    fig, (ax,) = _figure()
    lanes = sorted({s[0] for s in spans}, key=lambda lane: (utilisation.role_order(lane.split(",")[0]), lane))
    t0 = min((s[3] for s in spans), default=0.0)
    wide = 0.02 * (max((s[4] for s in spans), default=t0) - t0)  # a bar that has room for its label
    seen = set()
    for lane, stage, k, opened, committed in spans:
        y = lanes.index(lane)
        ax.broken_barh([(opened - t0, max(committed - opened, 1e-6))], (y - 0.35, 0.7),
                       facecolors=STAGE_COLOURS[stage], edgecolor="white", linewidth=0.5,
                       label=None if stage in seen else stage)
        seen.add(stage)
        if committed - opened >= wide:
            ax.text(opened - t0 + (committed - opened) / 2, y, str(k), ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4 + 0.6 * bool(lanes))  # room for the legend above the lanes
    _finish(fig, ax, f"{run_name}: stages of the last {TIMELINE_ITERATIONS} iterations, opening to commit "
            "(iteration on each bar)", "", bool(spans), "no committed stage records its opening",
            legend_loc="upper center")
    ax.set_xlabel("seconds since the first bar opened")
    return fig


def write_plots(run: RunDir, exp: Experiment, out_dir: str | Path) -> list[Path]:
    """Write the run's figures as PNG files into out_dir; returns their paths."""
    df = iteration_table(run, exp, extra=EXTRA)
    if df.is_empty():
        raise InspectError(f"{run.root}: no committed stage yet; nothing to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = exp.run.name
    figures = {"reward.png": reward_figure(df, name), "kl_clipfrac.png": kl_figure(df, name),
               "response_length.png": length_figure(df, name, exp.generate.max_tokens),
               "stage_timings.png": timing_figure(df, name),
               "timeline.png": timeline_figure(stage_spans(run), name)}
    paths = []
    for filename, fig in figures.items():
        path = out / filename
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
