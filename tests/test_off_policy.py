"""The off-policy correction of stale samples (asynchronous generation, algorithm.max_staleness):
the truncated importance weight min(pi_old / pi_sampler, cap), the policy loss it weighs, its
statistics, the staleness metrics, and the sampler check that a stale batch skips."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from hpcrl import agreement, batches, commit, config, executors, losses, runs
from hpcrl.update import Update, staleness_metrics, update_metrics

OLD = [[-1.0, -0.5, -2.0, 0.0], [-0.2, -3.0, -1.0, -1.0]]
SAMPLER = [[-1.5, -0.5, -0.5, -9.0], [-1.0, -1.0, -1.0, -1.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]


def test_the_weight_is_truncated_masked_and_counted_as_by_hand():
    """Pins the weight's direction (old over sampler, not the inverse), its cap, that masked-out
    positions (one with a huge ratio) neither weigh nor enter the mean, max or clipped share, and
    that the weight carries no gradient."""
    old = torch.tensor(OLD, requires_grad=True)
    bw = losses.behaviour_weight(old, torch.tensor(SAMPLER), torch.tensor(MASK), cap=2.0)
    raw = np.exp(np.array(OLD) - np.array(SAMPLER))
    want = np.minimum(raw, 2.0) * np.array(MASK)
    np.testing.assert_allclose(bw.weight.numpy(), want, rtol=1e-6)
    assert want[1, 0] == 2.0 and want[0, 3] == 0.0  # exp(0.8) truncated; exp(9) masked out
    kept = want[np.array(MASK) == 1]
    assert float(bw.mean) == pytest.approx(kept.mean(), rel=1e-6)
    assert float(bw.max) == pytest.approx(2.0) and float(bw.clipfrac) == pytest.approx(1 / 5)
    assert not bw.weight.requires_grad
    # a log-ratio beyond max_log_ratio is bounded before exp: the weight is the cap, not inf or nan
    huge = losses.behaviour_weight(torch.tensor([[500.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), cap=3.0)
    assert huge.weight.tolist() == [[3.0]] and float(huge.clipfrac) == 1.0
    empty = losses.behaviour_weight(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), cap=2.0)
    assert (float(empty.mean), float(empty.max), float(empty.clipfrac)) == (0.0, 0.0, 0.0)


def test_the_policy_loss_weighs_only_the_surrogate_tokens():
    """Pins where the weight enters: each token's clipped-surrogate loss times its weight, token
    mean over the mask; the KL penalty is not weighted; a weight of ones changes nothing."""
    mask = torch.tensor(MASK)
    logp, old = torch.tensor(SAMPLER) * 0.5, torch.tensor(OLD)
    adv = torch.tensor([1.0, -2.0])
    ref = torch.tensor(OLD) - 0.3
    w = torch.tensor([[0.5, 2.0, 1.0, 7.0], [1.5, 0.25, 3.0, 3.0]])
    params = losses.LossParams(clip_ratio=0.2)
    kw = dict(ref_logp=ref, kl_coef=0.1)
    out = losses.policy_loss_of(losses.ppo_surrogate, logp, old, adv, mask, params, behaviour_weight=w, **kw)
    r = np.exp(logp.numpy() - old.numpy())
    a = adv.numpy()[:, None]
    tokens = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    m = mask.numpy()
    pg = (tokens * w.numpy() * m).sum() / m.sum()
    kl = ((np.exp(ref.numpy() - logp.numpy()) + logp.numpy() - ref.numpy() - 1) * m).sum() / m.sum()
    assert float(out.pg_loss) == pytest.approx(pg, rel=1e-5)
    assert float(out.loss) == pytest.approx(pg + 0.1 * kl, rel=1e-5)
    plain = losses.policy_loss_of(losses.ppo_surrogate, logp, old, adv, mask, params, **kw)
    ones = losses.policy_loss_of(losses.ppo_surrogate, logp, old, adv, mask, params,
                                 behaviour_weight=torch.ones_like(logp), **kw)
    assert float(plain.pg_loss) == pytest.approx((tokens * m).sum() / m.sum(), rel=1e-5)
    assert (float(ones.loss), float(ones.pg_loss)) == (float(plain.loss), float(plain.pg_loss))
    assert float(ones.clipfrac) == float(out.clipfrac) == float(plain.clipfrac)


def test_update_metrics_average_the_weight_and_take_its_largest():
    """Pins the aggregation of the off-policy statistics over steps (means, and the max of the
    maxima), and that steps without the correction (null) leave the metrics out."""
    stats = [{"off_policy_weight_mean": 1.0, "off_policy_clipfrac": 0.1, "off_policy_weight_max": 2.0},
             {"off_policy_weight_mean": 0.5, "off_policy_clipfrac": 0.3, "off_policy_weight_max": 1.5}]
    m = update_metrics(stats, 1.0)
    assert m["actor/off_policy_weight_mean"] == pytest.approx(0.75)
    assert m["actor/off_policy_clipfrac"] == pytest.approx(0.2)
    assert m["actor/off_policy_weight_max"] == 2.0
    off = update_metrics([dict.fromkeys(stats[0])], 1.0)
    assert not any(k.startswith("actor/off_policy") for k in off)


def test_load_samples_reads_the_policy_version_of_each_training_row():
    """Pins the policy version that follows each kept training row (a misaligned or missing one
    would price staleness, and skip the sampler check, on the wrong rows)."""
    n = 6
    rollouts = pa.table({"split": ["train"] * 4 + ["val"] * 2,
                         "prompt_index": pa.array([4, 4, 5, 5, 0, 1], pa.int64()),
                         "sample_index": pa.array([0, 1, 0, 1, 0, 0], pa.int32()),
                         "prompt_ids": [[1]] * n, "response_ids": [[2, 3]] * n,
                         "logprobs": [[-0.1, -0.2]] * n,
                         "policy_version": pa.array([3, 2, 3, 1, 3, 3], pa.int32()),
                         "kept": [True, True, False, True, False, False]})
    scores = pa.table({c: rollouts[c] for c in ("split", "prompt_index", "sample_index")}
                      | {"reward": [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]})
    samples = batches.load_samples(rollouts, scores)
    assert samples.policy_versions.dtype == torch.int64 and samples.policy_versions.tolist() == [3, 2, 1]
    assert staleness_metrics(3, samples.policy_versions) == {"rollout/staleness_mean": 1.0,
                                                             "rollout/staleness_max": 2.0}


def _checked(exp, k: int, versions: list[int], diff: float) -> dict:
    """Update._check_sampler on a batch of 2 one-token samples whose trainer and sampler logprobs
    differ by `diff`; the metrics it records."""
    update = Update.__new__(Update)
    update.exp, update.ctx = exp, SimpleNamespace(iteration=k)
    update.samples = SimpleNamespace(sampler_logprobs=[[-1.0], [-1.0]],
                                     policy_versions=torch.tensor(versions))
    state = SimpleNamespace(old={0: [-1.0 + diff], 1: [-1.0 + diff]}, metrics={})
    update._check_sampler(state)
    return state.metrics


def test_the_sampler_check_skips_a_stale_batch_and_still_records_the_mismatch(write_experiment):
    """Pins both ways of getting the skip wrong: a stale batch (generated by an older policy,
    which legitimately differs) refused as a trainer/sampler mismatch, and a fresh batch, or one
    mixing fresh and stale samples, treated otherwise than intended (fresh: checked; any stale:
    not checked, the mismatch still recorded)."""
    exp = config.load(write_experiment(algorithm={"max_staleness": 1}))
    with pytest.raises(agreement.ModelMismatchError):
        _checked(exp, 2, [2, 2], 0.5)
    m = _checked(exp, 2, [1, 2], 0.5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.5)
    assert (m["rollout/staleness_mean"], m["rollout/staleness_max"]) == (0.5, 1.0)
    assert _checked(exp, 2, [2, 2], 0.0)["rollout/staleness_max"] == 0.0


class WeightsOnlyUpdate(executors.StageCall):
    """The update stage job that starts policy version 1 from its weights alone (no DeepSpeed
    state: the test commits update 0's policy by hand)."""

    def __call__(self) -> None:
        from hpcrl.rundir import RunDir

        RunDir.trainer_state_dir = lambda self, version: None
        super().__call__()


def _commit_stale_inputs(run, exp) -> None:
    """Iteration 0's generate, score and (by hand: the base weights as policy 1) update, and
    iteration 1's generate and score from policy version 0, its sampler logprobs perturbed."""
    from transformers import AutoTokenizer

    from tests import synthetic_run
    from tests.test_update_deepspeed import _commit_inputs

    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    rollouts = commit.read_table(run.stage_dir(0, "generate"), "rollouts")
    scores = commit.read_table(run.stage_dir(0, "score"), "scores")
    rng = np.random.default_rng(1)
    synthetic_run.commit_update(run, exp, 0, rollouts, scores, rng, policy_from=Path(exp.model.path))
    perturbed = [[x + float(rng.normal(0, 0.5)) for x in row] for row in rollouts["logprobs"].to_pylist()]
    rollouts = (rollouts.set_column(0, "iteration", pa.array([1] * rollouts.num_rows, pa.int32()))
                .set_column(rollouts.column_names.index("logprobs"), "logprobs",
                            pa.array(perturbed, pa.list_(pa.float32()))))
    for stage, name, table in (("generate", "rollouts", rollouts), ("score", "scores", scores)):
        w = commit.StageWriter(commit.fresh_temp_dir(run.stage_dir(1, stage)))
        w.write_table(name, table)
        commit.commit(run.stage_dir(1, stage), w, {"stage": stage, "policy_version": 0})


@pytest.mark.timeout(900)
def test_a_stale_update_is_corrected_and_not_refused(write_experiment, monkeypatch):
    """Pins the correction end to end on a real DeepSpeed update of iteration 1 on samples of
    policy version 0 whose sampler logprobs are far from the trainer's: the update is not refused
    by the sampler check, records the weight per step and the staleness, and commits."""
    exp = config.load(write_experiment("stale", algorithm={"max_staleness": 1}, run={"iterations": 2}))
    run, _ = runs.prepare(exp, "stale")
    _commit_stale_inputs(run, exp)
    monkeypatch.setattr(executors, "_calls", lambda run, exp, stage, it: [WeightsOnlyUpdate(
        "stages.update", str(run.root), it)])
    executors.LocalExecutor(run, exp).submit("update", 1).job.results()
    d = run.stage_dir(1, "update")
    assert commit.is_committed(d)
    stats = commit.read_table(d, "stats").to_pylist()
    assert len(stats) == 2
    for s in stats:
        assert 0 < s["off_policy_weight_mean"] and s["off_policy_weight_max"] == pytest.approx(2.0)
        assert 0 < s["off_policy_clipfrac"] < 1
    metrics = commit.read_manifest(d)["metrics"]
    assert metrics["rollout/staleness_mean"] == metrics["rollout/staleness_max"] == 1.0
    assert metrics["rollout/logprob_diff_mean"] > 0.1  # far beyond the tolerance, not checked
    assert metrics["actor/off_policy_weight_max"] == pytest.approx(2.0)


def test_the_weight_bounds_its_log_ratio_below_and_counts_only_weights_above_the_cap():
    """pins: a log-ratio not bounded below by max_log_ratio (default 20), and a clipped fraction
    that counts a weight equal to the cap."""
    import math

    old = torch.tensor([[-30.0, -1.0]])
    sampler = torch.tensor([[-5.0, -1.0]])  # log-ratios -25 and 0
    mask = torch.ones_like(old)
    bw = losses.behaviour_weight(old, sampler, mask, cap=1.0)
    assert bw.weight[0, 0].item() == pytest.approx(math.exp(-20.0), rel=1e-5)
    assert bw.weight[0, 1].item() == 1.0 and bw.clipfrac.item() == 0.0  # exactly at the cap: not clipped
