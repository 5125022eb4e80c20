"""Inspecting a run directory: a per-iteration table, and the samples of one iteration.

The per-iteration table reads only the `_COMMIT.json` manifests, where each stage recorded its
metrics and timings, so it costs the same for a run of a thousand rows or a billion. The detail of
one iteration (`iteration_detail`) scans that iteration's committed rollouts and scores lazily with
polars, reading only the columns it reports, after checking the files against their manifests.
A file that does not match its manifest raises hpcrl.commit.CorruptOutputError naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl

from hpcrl import commit, utilisation
from hpcrl.config import Experiment
from hpcrl.config_training import AlgorithmConfig
from hpcrl.rundir import RunDir
from hpcrl.schemas import SAMPLE_KEYS
from hpcrl.stage_kinds import GENERATE, KINDS, ORDER, SCORE

# (manifest metric, short header, format) of the per-iteration table, in order.
METRICS = (("critic/score/mean", "reward", ".3f"), ("val/score", "val", ".3f"), ("actor/ppo_kl", "kl", ".2e"),
           ("actor/kl_loss", "kl_loss", ".2e"), ("actor/pg_clipfrac", "clipfrac", ".3f"),
           ("response_length/mean", "len", ".1f"))
TIMINGS = tuple((f"timing_s/{s}", f"{KINDS[s].short}_s", ".1f") for s in ORDER)


class InspectError(RuntimeError):
    """A request the run directory cannot answer (an iteration or a stage that is not committed)."""


def metric_columns(a: AlgorithmConfig) -> list[tuple[str, str, str]]:
    """The table's columns for this run: actor/kl_loss only when a KL penalty is configured (the
    per-sample KL to the reference when it is a reward); the critic's explained variance for ppo."""
    metrics = [m for m in METRICS if m[0] != "actor/kl_loss" or a.kl.coef > 0]
    if a.kl.coef > 0 and a.kl.mode == "reward":
        metrics = [("actor/reward_kl_penalty", "kl_ref", ".2e") if m[0] == "actor/kl_loss" else m
                   for m in metrics]
    if a.name == "ppo":
        metrics.append(("critic/explained_variance", "ev", ".3f"))
    return [("iteration", "iter", "d"), *metrics, *TIMINGS]


def iteration_table(run: RunDir, exp: Experiment, extra: tuple[str, ...] = ()) -> pl.DataFrame:
    """One row per iteration with a committed stage: metrics from the manifests, stage times in s.

    `extra` names more manifest metrics to add as columns (e.g. "response_length/max").
    """
    columns = metric_columns(exp.algorithm) + [(key, key, ".4g") for key in extra]
    rows, roles = [], set()
    for k in run.iterations_present():
        found = {s: commit.read_manifest(run.stage_dir(k, s)) for s in ORDER}
        if not any(found.values()):
            continue
        metrics = {key: v for m in found.values() if m for key, v in m.get("metrics", {}).items()}
        for s, m in found.items():
            if m and "total" in m.get("timings", {}):
                metrics[f"timing_s/{s}"] = m["timings"]["total"]
        usage = utilisation.by_role(found.values())
        roles |= set(usage)
        rows.append({"iteration": k, **{key: metrics.get(key) for key, _, _ in columns[1:]},
                     **_utilisation_columns(usage)})
    keys = [key for key, _, _ in columns[1:]]
    keys += [f"util/{r}/{c}" for r in sorted(roles, key=utilisation.role_order) for c in UTIL_COLUMNS]
    schema = {"iteration": pl.Int64, **{key: pl.Float64 for key in keys}}
    return pl.DataFrame([[r["iteration"], *(r.get(key) for key in keys)] for r in rows], schema=schema,
                        orient="row")


# Per role, when the run's stages record their utilisation (hpcrl.utilisation): busy, allocated and
# idle device-seconds, devices held (gpu: 1 on GPUs, 0 on CPU cores) and busy / allocated.
UTIL_COLUMNS = ("utilisation", "busy_s", "allocated_s", "idle_s", "devices", "gpu")


def _utilisation_columns(usage: dict[str, utilisation.Usage]) -> dict[str, float | None]:
    return {f"util/{r}/{c}": v for r, u in usage.items()
            for c, v in zip(UTIL_COLUMNS, (u.utilisation, u.busy, u.allocated, u.idle, float(u.devices),
                                           float(u.device_type == "gpu")), strict=True)}


def utilisation_summary(df: pl.DataFrame) -> list[str]:
    """The run's utilisation per role and in total, from the table's util/ columns ([] without)."""
    roles = {}
    for col in df.columns:
        if col.startswith("util/") and col.endswith("/utilisation"):
            p = col.removesuffix("utilisation")
            roles[col.split("/")[1]] = utilisation.Usage(
                device_type="gpu" if (df[p + "gpu"].max() or 0) > 0 else "cpu",
                devices=int(df[p + "devices"].max() or 0), busy=df[p + "busy_s"].sum(),
                allocated=df[p + "allocated_s"].sum())
    return utilisation.summary_lines(roles) if roles else []


def committed_file(stage_dir: Path, table: str) -> Path:
    """The parquet file of a committed table, after checking it against its manifest."""
    m = commit.read_manifest(stage_dir)
    if m is None:
        raise InspectError(f"{stage_dir}: not committed (no {commit.MANIFEST}); see `hpcrl status`")
    entry = m.get("tables", {}).get(table)
    if entry is None:
        raise commit.CorruptOutputError(f"{stage_dir / commit.MANIFEST}: lists no table {table!r}")
    path = stage_dir / entry["file"]
    meta = m.get("files", {}).get(entry["file"])
    if not path.is_file():
        raise commit.CorruptOutputError(f"{path}: missing (listed in {stage_dir / commit.MANIFEST})")
    if meta is None or path.stat().st_size != meta["bytes"] or commit.file_digest(path)[7:] != meta["sha256"]:
        raise commit.CorruptOutputError(f"{path}: checksum mismatch with {stage_dir / commit.MANIFEST}")
    return path


def _collect(frame: pl.LazyFrame, *paths: Path) -> pl.DataFrame:
    try:
        return frame.collect()
    except (pl.exceptions.PolarsError, OSError) as err:
        raise commit.CorruptOutputError(f"{', '.join(map(str, paths))}: unreadable parquet ({err})") from None


def _samples(df: pl.DataFrame, rollouts: Path, n: int) -> pl.DataFrame:
    """The n best and n worst samples of each split, with their prompt and response texts."""
    picked = []
    for _, part in df.group_by("split", maintain_order=True):
        ordered = part.sort(["reward", "row"], descending=[True, False])
        best = ordered.head(n).with_columns(kind=pl.lit("best"), rank=pl.int_range(1, pl.len() + 1))
        worst = part.sort(["reward", "row"]).head(n).with_columns(kind=pl.lit("worst"),
                                                                  rank=pl.int_range(1, pl.len() + 1))
        picked += [best, worst]
    if not picked:
        return pl.DataFrame()
    chosen = pl.concat(picked)
    texts = _collect(pl.scan_parquet(rollouts).with_row_index("row")
                     .filter(pl.col("row").is_in(chosen["row"].unique().implode()))
                     .select("row", "prompt_text", "response_text"), rollouts)
    order = ["split", "kind", "rank", "reward", "data_source", "prompt_index", "sample_index",
             "response_length", "finish_reason", "prompt_text", "response_text"]
    return chosen.join(texts, on="row", how="left").select(order).with_columns(pl.col("rank").cast(pl.Int64))


def iteration_detail(run: RunDir, k: int, samples: int = 3) -> dict[str, pl.DataFrame | dict]:
    """Rewards by data source, response lengths, finish reasons and the best/worst samples of iteration k."""
    present = run.iterations_present()
    if k not in present:
        span = f"{present[0]}..{present[-1]}" if present else "none yet"
        raise InspectError(f"{run.root}: no iteration {k} (iterations present: {span})")
    gen, scored = run.stage_dir(k, GENERATE), run.stage_dir(k, SCORE)
    rollouts, scores = committed_file(gen, "rollouts"), committed_file(scored, "scores")
    r = pl.scan_parquet(rollouts).select(
        *SAMPLE_KEYS, "data_source", "finish_reason", response_length=pl.col("response_ids").list.len())
    s = pl.scan_parquet(scores).select(*(pl.col(c).alias(f"_{c}") for c in SAMPLE_KEYS), "reward")
    df = _collect(pl.concat([r, s], how="horizontal").with_row_index("row"), rollouts, scores)
    if not df.select(pl.all_horizontal(pl.col(c).eq_missing(pl.col(f"_{c}"))
                                       for c in SAMPLE_KEYS).all()).item():
        raise commit.CorruptOutputError(f"{scores}: rows do not line up with {rollouts} (sample keys differ)")
    df = df.drop([f"_{c}" for c in SAMPLE_KEYS]).with_columns(pl.col("data_source").fill_null("(none)"),
                                                              pl.col("finish_reason").fill_null("(none)"))
    split_order = pl.col("split").replace_strict({"train": 0, "val": 1}, default=2, return_dtype=pl.Int8)

    def by(*keys: str, **aggs: pl.Expr) -> pl.DataFrame:
        return df.group_by(*keys).agg(**aggs).sort(split_order, *keys[1:])

    reward_stats = dict(count=pl.len(), mean=pl.col("reward").mean(), std=pl.col("reward").std(),
                        min=pl.col("reward").min(), max=pl.col("reward").max())
    rewards = pl.concat([by("split", "data_source", **reward_stats),
                         by("split", **reward_stats).with_columns(data_source=pl.lit("(all)"))],
                        how="diagonal")
    rewards = rewards.sort(split_order, pl.col("data_source") == "(all)", "data_source")
    length = pl.col("response_length")
    lengths = by("split", count=pl.len(), mean=length.mean(),
                 p50=length.quantile(0.5, "linear"), p90=length.quantile(0.9, "linear"), max=length.max())
    finish = by("split", "finish_reason", count=pl.len())
    info = {"iteration": k, "policy_version": (commit.read_manifest(gen) or {}).get("policy_version"),
            "rows": dict(df.group_by("split", maintain_order=True).len().iter_rows())}
    return {"info": info, "rewards": rewards, "response_length": lengths, "finish_reasons": finish,
            "samples": _samples(df, rollouts, samples)}


# ---- rendering -----------------------------------------------------------------------------------

def _cell(value: object, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt) if fmt else str(value)


def _text_table(df: pl.DataFrame, formats: dict[str, str], headers: dict[str, str] | None = None) -> str:
    headers = headers or {}
    cols = df.columns
    cells = [[headers.get(c, c) for c in cols]]
    cells += [[_cell(v, formats.get(c, "")) for c, v in zip(cols, row, strict=True)]
              for row in df.iter_rows()]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cols))]
    numeric = [df.schema[c].is_numeric() for c in cols]
    return "\n".join("  ".join(v.rjust(w) if num else v.ljust(w)
                               for v, w, num in zip(r, widths, numeric, strict=True))
                     .rstrip() for r in cells)


def _json_default(value: object) -> object:
    return str(value)


def _clean(records: list[dict]) -> list[dict]:
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in records]


def render_table(df: pl.DataFrame, exp: Experiment, fmt: str) -> str:
    """The per-iteration table as text, CSV or JSON (JSON and CSV use the metric names)."""
    if fmt == "json":
        return json.dumps(_clean(df.to_dicts()), indent=1)
    if fmt == "csv":
        return df.write_csv().rstrip("\n")
    cols = metric_columns(exp.algorithm)
    formats, headers = {k: f for k, _, f in cols}, {k: h for k, h, _ in cols}
    shown = [c for c in df.columns if not c.startswith("util/") or c.endswith("/utilisation")]
    for c in shown:
        if c.startswith("util/"):  # each role's busy / allocated, as a percentage
            role = c.split("/")[1]
            formats[c], headers[c] = ".0%", f"{utilisation.SHORT.get(role, role)}_util"
    return "\n".join([_text_table(df.select(shown), formats, headers), *utilisation_summary(df)])


def _clip(text: str | None, limit: int = 240) -> str:
    text = (text or "").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit // 3] + " [...] " + text[-(2 * limit // 3):]


def render_detail(detail: dict, fmt: str) -> str:
    """The detail of one iteration as text, one CSV (a `section` column), or JSON."""
    sections = ("rewards", "response_length", "finish_reasons", "samples")
    if fmt == "json":
        out = {**detail["info"], **{s: _clean(detail[s].to_dicts()) for s in sections}}
        return json.dumps(out, indent=1, default=_json_default)
    if fmt == "csv":
        frames = [detail[s].with_columns(section=pl.lit(s)) for s in sections if detail[s].height]
        return pl.concat(frames, how="diagonal_relaxed").select("section", pl.exclude("section")) \
            .write_csv().rstrip("\n")
    info = detail["info"]
    rows = ", ".join(f"{n} {s}" for s, n in sorted(info["rows"].items()))
    out = [f"iteration {info['iteration']} (policy v{info['policy_version']}): {rows} samples", "",
           "reward by data source"]
    num = {"mean": ".3f", "std": ".3f", "min": ".3f", "max": ".3f", "p50": ".1f", "p90": ".1f"}
    out += [_text_table(detail["rewards"], num), "", "response length (tokens)",
            _text_table(detail["response_length"], {**num, "mean": ".1f", "max": "d"}), "", "finish reasons",
            _text_table(detail["finish_reasons"], {})]
    for row in detail["samples"].iter_rows(named=True):
        if row["rank"] == 1:
            out += ["", f"{row['kind']} {row['split']} samples"]
        out.append(f"  #{row['rank']} reward {row['reward']:.3f}  prompt {row['prompt_index']} sample "
                   f"{row['sample_index']}  {row['data_source']}  {row['response_length']} tokens "
                   f"({row['finish_reason']})")
        out.append(f"     prompt:   {_clip(row['prompt_text'])}")
        out.append(f"     response: {_clip(row['response_text'])}")
    return "\n".join(out)
