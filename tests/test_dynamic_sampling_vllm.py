"""DAPO dynamic sampling end to end on the tiny task: real vLLM rounds in the generate stage, the
score stage over every group, and a real DeepSpeed update that trains on the kept groups only."""

from __future__ import annotations

import pytest

from hpcrl import commit, config, executors, runs, scoring
from hpcrl.stage import run_stage

pytestmark = pytest.mark.timeout(600)


def test_dynamic_sampling_adds_rounds_and_the_update_trains_on_the_kept_groups(write_experiment, own_engine):
    from hpcrl.generation import GenerateStage

    # Groups of 2 at policy v0 are often both right or both wrong (exact match near 0.4), so
    # round 0's 8 prompts leave the batch short of informative groups.
    exp = config.load(write_experiment(
        "dapo", run={"iterations": 1, "eval_every": 0}, data={"test": ""},
        algorithm={"group_size": 2, "prompts_per_iteration": 8, "dynamic_sampling": True,
                   "max_sampling_rounds": 4}))
    run, _ = runs.prepare(exp, "dapo")
    gen = run_stage("generate", run.root, 0, lambda ctx: GenerateStage(ctx.exp, ctx.run).job(ctx))
    run_stage("score", run.root, 0, scoring.score_stage)
    job = executors.LocalExecutor(run, exp).submit("update", 0)
    job.job.results()

    rollouts = commit.read_table(run.stage_dir(0, "generate"), "rollouts").to_pylist()
    scores = commit.read_table(run.stage_dir(0, "score"), "scores").to_pylist()
    assert len(scores) == len(rollouts)  # every sampled group is scored and committed
    groups: dict[int, dict] = {}
    for r, s in zip(rollouts, scores, strict=True):
        g = groups.setdefault(r["prompt_index"], {"round": r["round"], "kept": set(), "rewards": []})
        g["kept"].add(r["kept"])
        g["rewards"].append(s["reward"])
    m = gen["metrics"]
    assert (m["dapo/rounds"] >= 2
            and sorted({g["round"] for g in groups.values()}) == list(range(int(m["dapo/rounds"]))))
    assert m["dapo/generated_groups"] == len(groups) == 8 * m["dapo/rounds"]
    assert all(len(g["kept"]) == 1 for g in groups.values())  # a group is kept or left out whole
    kept = {p for p, g in groups.items() if True in g["kept"]}
    informative = {p for p, g in groups.items() if len(set(g["rewards"])) > 1}
    assert len(kept) == 8
    assert (len(kept & informative) == m["dapo/kept_groups"]
            and len(kept - informative) == m["dapo/padded_groups"])
    assert m["dapo/dropped_all_equal"] == len(set(groups) - kept - informative) > 0
    if m["dapo/padded_groups"] == 0:
        assert kept <= informative

    adv = commit.read_table(run.stage_dir(0, "update"), "advantages").to_pylist()
    assert sorted((a["prompt_index"], a["sample_index"]) for a in adv) == sorted(
        (r["prompt_index"], r["sample_index"]) for r in rollouts if r["kept"])
    assert any(a["advantage"] != 0 for a in adv)
