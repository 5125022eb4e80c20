"""`hpcrl inspect`: the per-iteration table equals the manifests, the detail of an iteration is right
(checked by hand on a tiny run), every format parses, and a corrupted file is named, exit 1."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from hpcrl import commit, runs, schemas
from hpcrl import inspection as run_inspect
from hpcrl.rundir import RunDir
from tests import synthetic_run


def hpcrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def manifest_value(run: RunDir, k: int, key: str) -> float | None:
    for stage in ("generate", "score", "update"):
        m = commit.read_manifest(run.stage_dir(k, stage))
        if m is None:
            continue
        if key == f"timing_s/{stage}":
            return m["timings"]["total"]
        if key in m["metrics"]:
            return m["metrics"][key]
    return None


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory) -> RunDir:
    return synthetic_run.make_run(tmp_path_factory.mktemp("runs") / "kl", iterations=4, rows=64, val_rows=8,
                                  eval_every=2, kl_coef=0.1, group_size=4)


def test_table_values_equal_the_manifest_metrics(kl_run):
    run, exp = runs.open_run(kl_run.root)
    df = run_inspect.iteration_table(run, exp)
    assert df["iteration"].to_list() == [0, 1, 2, 3, 4]  # 4 trained iterations + the final validation
    assert "actor/kl_loss" in df.columns  # kl_coef > 0
    for row in df.iter_rows(named=True):
        for key, value in row.items():
            if key != "iteration":
                assert value == manifest_value(run, row["iteration"], key), (row["iteration"], key)
    assert df.filter(iteration=4)["actor/ppo_kl"].item() is None  # no update in the final iteration
    assert df["val/score"].is_null().to_list() == [False, True, False, True, False]


def test_json_and_csv_tables_parse_and_match(kl_run):
    out = hpcrl("inspect", kl_run.root, "--format", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1]["actor/kl_loss"] == manifest_value(kl_run, 1, "actor/kl_loss")
    assert rows[3]["timing_s/update"] == manifest_value(kl_run, 3, "timing_s/update")
    out = hpcrl("inspect", kl_run.root, "--format", "csv")
    assert out.returncode == 0, out.stderr
    records = list(csv.DictReader(io.StringIO(out.stdout)))
    assert len(records) == 5
    assert (float(records[2]["critic/score/mean"])
            == pytest.approx(manifest_value(kl_run, 2, "critic/score/mean"), rel=1e-12))
    assert records[4]["actor/ppo_kl"] == ""
    text = hpcrl("inspect", kl_run.root)
    assert text.returncode == 0, text.stderr
    header, *lines = text.stdout.splitlines()
    assert header.split() == ["iter", "reward", "val", "kl", "kl_loss", "clipfrac", "len", "gen_s", "score_s",
                              "update_s"]
    assert len(lines) == 5 and lines[1].split()[2] == "-"


def test_no_kl_loss_column_without_a_kl_penalty(tmp_path):
    run = synthetic_run.make_run(tmp_path / "r", iterations=1, rows=16, val_rows=4, group_size=4)
    out = hpcrl("inspect", run.root, "--format", "json")
    assert out.returncode == 0, out.stderr
    assert "actor/kl_loss" not in json.loads(out.stdout)[0] and "actor/ppo_kl" in json.loads(out.stdout)[0]


def _rollout(split, prompt, sample, source, n_tokens, finish, text):
    return {"iteration": 0, "split": split, "prompt_index": prompt, "sample_index": sample,
            "data_source": source, "prompt_text": f"prompt {prompt}?", "ground_truth": "1",
            "prompt_ids": [1, 2], "response_ids": list(range(n_tokens)), "logprobs": [-0.5] * n_tokens,
            "response_text": text, "finish_reason": finish, "policy_version": 0, "round": 0,
            "kept": split == "train"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> RunDir:
    """Iteration 0: 4 train samples (2 prompts x 2) and 2 validation samples, written by hand."""
    root = tmp_path_factory.mktemp("runs") / "tiny"
    exp = synthetic_run.write_config(root, iterations=1, eval_every=1, group_size=2, prompts_per_iteration=2)
    run = RunDir.at(root)
    rows = [_rollout("train", 7, 0, "gsm8k", 3, "stop", "one"),
            _rollout("train", 7, 1, "gsm8k", 5, "stop", "two"),
            _rollout("train", 9, 0, "math", 8, "length", "three"),
            _rollout("train", 9, 1, "math", 2, "stop", "four"),
            _rollout("val", 0, 0, "gsm8k", 4, "stop", "five"),
            _rollout("val", 1, 0, "gsm8k", 6, "stop", "six")]
    rollouts = pa.Table.from_pylist(rows, schema=schemas.ROLLOUTS)
    scores = synthetic_run.scores_table(rollouts, np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.0]))
    rng = np.random.default_rng(0)
    synthetic_run.commit_generate(run, exp, 0, rollouts, rng)
    synthetic_run.commit_score(run, 0, rollouts, scores, rng)
    return run


def test_detail_of_an_iteration_by_hand(tiny_run):
    d = run_inspect.iteration_detail(tiny_run, 0, samples=3)
    assert d["info"] == {"iteration": 0, "policy_version": 0, "rows": {"train": 4, "val": 2}}
    rewards = {(r["split"], r["data_source"]): r for r in d["rewards"].to_dicts()}
    assert list(rewards) == [("train", "gsm8k"), ("train", "math"), ("train", "(all)"), ("val", "gsm8k"),
                             ("val", "(all)")]
    assert rewards["train", "gsm8k"] == {"split": "train", "data_source": "gsm8k", "count": 2, "mean": 0.5,
                                         "std": pytest.approx(0.5 ** 0.5), "min": 0.0, "max": 1.0}
    assert (rewards["train", "math"]["mean"] == 0.25
            and rewards["train", "math"]["std"] == pytest.approx(0.125 ** 0.5))
    # train rewards 1, 0, .5, 0: mean .375, sample variance .6875 / 3
    assert rewards["train", "(all)"]["mean"] == 0.375
    assert rewards["train", "(all)"]["std"] == pytest.approx((0.6875 / 3) ** 0.5)
    assert rewards["val", "(all)"]["count"] == 2 and rewards["val", "(all)"]["mean"] == 0.5
    lengths = {r["split"]: r for r in d["response_length"].to_dicts()}
    # train lengths 3, 5, 8, 2 -> sorted 2, 3, 5, 8: median 4, p90 at 2.7 -> 5 + 0.7 * 3
    assert lengths["train"] == {"split": "train", "count": 4, "mean": 4.5, "p50": 4.0,
                                "p90": pytest.approx(7.1), "max": 8}
    assert lengths["val"]["mean"] == 5.0 and lengths["val"]["max"] == 6
    assert d["finish_reasons"].rows() == [("train", "length", 1), ("train", "stop", 3), ("val", "stop", 2)]
    samples = d["samples"]
    best = samples.filter(split="train", kind="best")
    worst = samples.filter(split="train", kind="worst")
    assert best.select("rank", "reward", "prompt_index", "sample_index", "response_text").rows() == [
        (1, 1.0, 7, 0, "one"), (2, 0.5, 9, 0, "three"), (3, 0.0, 7, 1, "two")]
    assert worst.select("reward", "prompt_index", "sample_index").rows() == [
        (0.0, 7, 1), (0.0, 9, 1), (0.5, 9, 0)]
    assert best["prompt_text"][0] == "prompt 7?" and best["finish_reason"][1] == "length"
    assert samples.filter(split="val", kind="best")["response_text"].to_list() == ["five", "six"]


def test_detail_formats_parse(tiny_run):
    out = hpcrl("inspect", tiny_run.root, "--iteration", 0, "--format", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["rows"] == {"train": 4, "val": 2}
    assert data["response_length"][0]["p90"] == pytest.approx(7.1)
    assert data["samples"][0]["response_text"] == "one"
    out = hpcrl("inspect", tiny_run.root, "--iteration", 0, "--format", "csv", "--samples", 1)
    assert out.returncode == 0, out.stderr
    records = list(csv.DictReader(io.StringIO(out.stdout)))
    sections = [r["section"] for r in records]
    assert sections == ["rewards"] * 5 + ["response_length"] * 2 + ["finish_reasons"] * 3 + ["samples"] * 4
    assert records[-4]["prompt_text"] == "prompt 7?" and float(records[-4]["reward"]) == 1.0
    text = hpcrl("inspect", tiny_run.root, "--iteration", 0)
    assert text.returncode == 0, text.stderr
    assert "iteration 0 (policy v0): 4 train, 2 val samples" in text.stdout
    assert "best train samples" in text.stdout and "response: three" in text.stdout


def test_missing_iteration_and_uncommitted_stage_are_refused(tiny_run, tmp_path):
    out = hpcrl("inspect", tiny_run.root, "--iteration", 5)
    assert out.returncode == 2 and "no iteration 5 (iterations present: 0..0)" in out.stderr
    run = synthetic_run.make_run(tmp_path / "r", iterations=1, rows=8, val_rows=0, group_size=4)
    (run.stage_dir(0, "score") / commit.MANIFEST).unlink()  # as if the score stage never committed
    out = hpcrl("inspect", run.root, "--iteration", 0)
    assert out.returncode == 2 and f"{run.stage_dir(0, 'score')}: not committed" in out.stderr


def test_corrupted_parquet_is_named_and_exits_1(tmp_path):
    run = synthetic_run.make_run(tmp_path / "r", iterations=2, rows=32, val_rows=4, group_size=4)
    path = run.stage_dir(1, "generate") / "rollouts.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    out = hpcrl("inspect", run.root, "--iteration", 1)
    assert out.returncode == 1
    assert out.stderr.strip() == f"error: {path}: checksum mismatch with {path.parent / commit.MANIFEST}"
    assert hpcrl("inspect", run.root, "--iteration", 0).returncode == 0  # other iterations still answer
    manifest = run.stage_dir(0, "update") / commit.MANIFEST
    manifest.write_text(manifest.read_text()[:-20])
    out = hpcrl("inspect", run.root)
    assert out.returncode == 1 and f"error: {manifest}: damaged, not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr
