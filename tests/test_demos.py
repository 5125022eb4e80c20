"""The shipped demos learn: `configs/demo.toml` (GRPO) and `configs/demo-ppo.toml` (PPO with a critic),
run whole as a user runs them (resident mode, real vLLM and DeepSpeed), against the acceptance of the
spine issue (reward of the last 3 iterations at least 0.3 above the first; validation score up at
least 0.2); the GRPO demo with the gspo and cispo policy losses too; and, for PPO, a critic whose
explained variance rises over the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import inspection, plots
from hpcrl.config import load
from hpcrl.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)  # about 35 s and 45 s on 2 quiet CPU cores


def run_demo(config: str, tiny_task: Path, runs_root: Path, quiet: bool = True, **sets):
    """Submit the config as shipped, with its task paths pointed at the test session's build (and
    `sets`, dotted keys with "__" for ".", set too); `quiet`: the default alerts stay quiet."""
    overrides = {"run.runs_root": runs_root, "model.path": tiny_task / "model",
                 "data.train": tiny_task / "data" / "train.parquet",
                 "data.test": tiny_task / "data" / "test.parquet",
                 **{key.replace("__", "."): value for key, value in sets.items()}}
    args = [arg for key, value in overrides.items()  # TOML values: JSON's strings and lists are TOML's
            for arg in ("--set", f"{key}={json.dumps(value if isinstance(value, list) else str(value))}")]
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(REPO / "configs" / config), *args],
                         capture_output=True, text=True, timeout=800)
    assert out.returncode == 0, out.stdout + out.stderr
    run = run_of(runs_root)
    exp = load(run.config_path)
    if quiet:
        assert "alerts" not in run.read_run_info() and "ALERT" not in out.stdout
    return exp, inspection.iteration_table(run, exp), out.stdout


def run_of(runs_root: Path) -> RunDir:
    [run_dir] = [p for p in runs_root.iterdir() if p.is_dir() and (p / "run.json").is_file()]
    return RunDir.at(run_dir)


def assert_learns(exp, table) -> None:
    reward = table["critic/score/mean"].drop_nulls().to_list()
    val = table["val/score"].drop_nulls().to_list()
    assert len(reward) == exp.run.iterations and len(val) >= 2
    assert sum(reward[-3:]) / 3 - reward[0] >= 0.3, reward
    assert val[-1] - val[0] >= 0.2, val


def test_grpo_demo_learns_the_task(tiny_task, tmp_path):
    exp, table, out = run_demo("demo.toml", tiny_task, tmp_path)
    assert exp.algorithm.name == "grpo" and exp.executor.mode == "resident"
    assert_learns(exp, table)
    assert "run complete" in out


@pytest.mark.parametrize(("loss", "lr"), [("gspo", 2e-4), ("cispo", 1.5e-4)], ids=["gspo", "cispo"])
def test_the_demo_learns_with_gspo_and_cispo(loss, lr, tiny_task, tmp_path):
    """cispo at 0.75x the demo's learning rate: its clipped weight carries no gradient, so no
    token's update stops at the clip, and at the demo's rate the gain moves around the acceptance
    with the CPU's rounding (0.29 and 0.31 on two Xeons, 0.26 and 0.16 at 1.5x and 2x); at 0.75x
    the reward climbs steadily (0.46 on an AMX Xeon, 0.43 at 0.6x)."""
    exp, table, out = run_demo("demo.toml", tiny_task, tmp_path, quiet=False, algorithm__policy_loss=loss,
                               update__lr=lr)
    assert exp.algorithm.policy_loss == loss
    assert_learns(exp, table)
    table = inspection.iteration_table(run_of(tmp_path), exp,
                                       ("actor/is_weight_mean", "actor/is_weight_max"))
    weights = table["actor/is_weight_mean"].drop_nulls().to_list()
    assert len(weights) == exp.run.iterations and all(0.5 < w < 2.0 for w in weights), weights
    assert max(table["actor/is_weight_max"].drop_nulls().to_list()) > 1.0  # two mini-batches: the 2nd moved


def test_the_demo_learns_with_lora_adapters_and_syncs_a_tenth_of_the_bytes(tiny_task, tmp_path):
    """[update.lora]: only rank-8 adapters on every linear layer train (at 10x the demo's learning
    rate; on the attention projections alone the gain stays near the acceptance, 0.29 measured);
    after the first, full, sync each update sends the engine only the adapters (8% of the bytes),
    which it merges into its weights, and the probe agrees as closely as with full syncs. pins: a
    sync that resends every weight, an engine that loads the adapters unmerged or onto the wrong
    base (the probe would refuse it), a policy version saved without its adapters."""
    from hpcrl import commit

    every_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    exp, table, _ = run_demo("demo.toml", tiny_task, tmp_path, update__lora__rank=8, update__lr=2e-3,
                             update__lora__target_modules=every_linear)
    assert exp.update.lora.rank == 8 and exp.update.lora.target_modules == every_linear
    assert_learns(exp, table)
    run = run_of(tmp_path)
    full = commit.read_manifest(run.stage_dir(0, "generate"))["metrics"]
    for k in range(1, exp.run.iterations):
        sync = commit.read_manifest(run.stage_dir(k, "generate"))["metrics"]
        assert 0 < sync["sync/bytes"] <= full["sync/start_bytes"] / 10, (k, sync, full)
        assert sync["sync/logp_diff"] < 1e-4
    last = run.stage_dir(exp.run.iterations - 1, "update") / "policy"
    assert (last / "adapter" / "adapter_model.safetensors").is_file()
    assert (last / "model.safetensors").is_file()


def test_the_demo_learns_with_remax_against_its_greedy_baselines(tiny_task, tmp_path):
    import pyarrow.parquet as pq

    exp, table, _ = run_demo("demo.toml", tiny_task, tmp_path, quiet=False, algorithm__name="remax")
    assert_learns(exp, table)
    run = run_of(tmp_path)
    rollouts = pq.read_table(run.stage_dir(2, "generate") / "rollouts.parquet").to_pylist()
    scores = {(r["split"], r["prompt_index"], r["sample_index"]): r["reward"]
              for r in pq.read_table(run.stage_dir(2, "score") / "scores.parquet").to_pylist()}
    baselines = {r["prompt_index"] for r in rollouts if r["split"] == "baseline"}
    assert baselines == {r["prompt_index"] for r in rollouts if r["split"] == "train"}  # one per prompt
    assert len(baselines) == exp.algorithm.prompts_per_iteration
    adv = pq.read_table(run.stage_dir(2, "update") / "advantages.parquet").to_pylist()
    assert len(adv) == exp.algorithm.prompts_per_iteration * exp.algorithm.group_size  # baselines not trained
    for row in adv:
        expected = scores[("train", row["prompt_index"], row["sample_index"])] - scores[
            ("baseline", row["prompt_index"], 0)]
        assert row["advantage"] == pytest.approx(expected, abs=1e-6)


def test_ppo_demo_learns_the_task_and_its_critic_explains_more_and_more(tiny_task, tmp_path):
    exp, table, out = run_demo("demo-ppo.toml", tiny_task, tmp_path)
    assert exp.algorithm.name == "ppo"
    assert_learns(exp, table)
    ev = table["critic/explained_variance"].to_list()[: exp.run.iterations]  # the last row: final validation
    assert len(ev) == exp.run.iterations and all(x is not None for x in ev), ev  # logged every iteration
    assert ev[0] == pytest.approx(0.0, abs=1e-6)  # the new value head is zero
    first, last = sum(ev[:3]) / 3, sum(ev[-3:]) / 3
    assert last >= 0.3 and last - first >= 0.2, ev  # rising, and explaining a good part of the returns
    assert "critic/explained_variance" in out.splitlines()[-1]  # the summary line reports it


@pytest.mark.parametrize("config", ["demo.toml", "demo-ppo.toml"])
def test_the_demos_learn_with_asynchronous_generation(config, tiny_task, tmp_path, monkeypatch):
    """Issue #18: both demos with algorithm.max_staleness = 1 (each iteration samples with the policy
    of one update before, corrected by the truncated importance weight) meet the acceptance above.
    The GRPO demo's reward waits 1 ms per sample, as a remote judge would (tools/latency_reward.py):
    each score runs beside the next generation (executor.resident.overlap_score)."""
    slow = {}
    if config == "demo.toml":
        monkeypatch.setenv("PYTHONPATH", str(REPO / "tools"))  # for the job's processes
        monkeypatch.setenv("LATENCY_REWARD_WAIT_S", "0.001")
        slow = {"reward__functions": ["latency_reward:exact_match_after_a_wait"]}
    exp, table, _ = run_demo(config, tiny_task, tmp_path, quiet=False, algorithm__max_staleness=1, **slow)
    assert_learns(exp, table)
    if slow:
        assert_scored_beside(run_of(tmp_path), exp)
    extra = ("rollout/staleness_mean", "actor/off_policy_weight_mean", "actor/off_policy_weight_max")
    table = inspection.iteration_table(run_of(tmp_path), exp, extra)[: exp.run.iterations]
    assert table["rollout/staleness_mean"].to_list() == [0.0] + [1.0] * (exp.run.iterations - 1)
    weights = table["actor/off_policy_weight_mean"].drop_nulls().to_list()  # not in ppo's critic warmup
    warmup = exp.algorithm.critic.warmup if exp.algorithm.critic else 0
    assert len(weights) == exp.run.iterations - warmup and all(0.5 < w < 1.5 for w in weights), weights
    assert max(table["actor/off_policy_weight_max"].drop_nulls().to_list()) <= exp.algorithm.off_policy_cap
    if exp.algorithm.name == "ppo":
        ev = table["critic/explained_variance"].to_list()
        assert sum(ev[-3:]) / 3 >= 0.3 and sum(ev[-3:]) / 3 - sum(ev[:3]) / 3 >= 0.2, ev


def assert_scored_beside(run: RunDir, exp) -> None:
    """The first score ran while the second generation did (that one samples with the base model:
    it waits for no update), and each update began once its score had committed; pins a generator
    that scores between two generations, or commands an update before its score commits."""
    from hpcrl import commit

    def span(k: int, stage: str) -> tuple[float, float]:
        m = commit.read_manifest(run.stage_dir(k, stage))
        return m["opened_at"], m["committed_at"]

    score, following = span(0, "score"), span(1, "generate")
    assert score[0] < following[1] and following[0] < score[1], (score, following)
    for k in range(exp.run.iterations):
        assert span(k, "score")[1] <= span(k, "update")[0], k
        assert commit.read_manifest(run.stage_dir(k, "score"))["utilisation"]["beside"] is True
    lanes = {(lane, stage) for lane, stage, *_ in plots.stage_spans(run)}  # timeline.png's lanes
    assert lanes == {("generator", "generate"), ("generator, beside", "score"), ("trainer", "update")}
