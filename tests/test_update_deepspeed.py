"""The update stage with real DeepSpeed (gloo on CPU): 1 and 2 ranks, ZeRO 2 and 3.

Inputs are committed synthetic rollouts of the tiny task; the stage runs as the product runs it,
through submitit's LocalExecutor with one task per rank.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from hpcrl import commit, config, executors, runs
from hpcrl.rundir import RunDir

pytestmark = pytest.mark.timeout(900)


def _sampler_logprobs(rows: list[dict], exp: config.Experiment, policy) -> None:
    """The logprobs a sampler holding the policy at `policy` reports for these responses: the
    update checks its own against them (update.sampler_mismatch_tol)."""
    from hpcrl import losses, policy_model

    model = policy_model.load_causal_lm(policy, torch.float32)
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            logits = model(ids).logits[:, len(row["prompt_ids"]) - 1: -1]
            row["logprobs"] = losses.token_logprobs(logits, ids[:, len(row["prompt_ids"]):],
                                                    exp.generate.temperature or 1.0)[0].tolist()


def _commit_inputs(run: RunDir, exp: config.Experiment, tokenizer, sampler_logprob: float | None = None,
                   reward: float | None = None, iteration: int = 0) -> None:
    """Committed generate and score outputs of `iteration`, sampled by its policy version: the
    policy's own logprobs as the sampler's, or `sampler_logprob` for every token (a sampler far
    from the trainer); each sample's correctness as its reward, or `reward` for all."""
    rng = np.random.default_rng(0)
    rows = []
    for p in range(exp.algorithm.prompts_per_iteration):
        a, b = rng.integers(10, 99, size=2)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+{b}="}], tokenize=False,
                                               add_generation_prompt=True)
        for s in range(exp.algorithm.group_size):
            answer = str(a + b) if rng.random() < 0.4 else f"{a + b:04d}"
            ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
            rows.append(dict(iteration=iteration, split="train", prompt_index=p, sample_index=s,
                             data_source="tiny_addition", prompt_text=prompt, ground_truth=str(a + b),
                             prompt_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"],
                             response_ids=ids, logprobs=[-1.0] * len(ids), response_text=answer,
                             finish_reason="stop", policy_version=iteration, round=0, kept=True))
    if sampler_logprob is None:
        _sampler_logprobs(rows, exp, run.policy_dir(iteration, exp.model.path))
    rollouts = pa.Table.from_pylist(rows)
    w = commit.StageWriter(commit.fresh_temp_dir(run.stage_dir(iteration, "generate")))
    w.write_table("rollouts", rollouts)
    commit.commit(run.stage_dir(iteration, "generate"), w, {"stage": "generate", "policy_version": iteration})
    reward = [float(r["response_text"] == r["ground_truth"]) if reward is None else reward for r in rows]
    w = commit.StageWriter(commit.fresh_temp_dir(run.stage_dir(iteration, "score")))
    w.write_table("scores", pa.table({
        "split": rollouts["split"], "prompt_index": rollouts["prompt_index"],
        "sample_index": rollouts["sample_index"], "reward": reward,
        "reward_components": pa.array([[("r", x)] for x in reward], pa.map_(pa.string(), pa.float64())),
        "reward_message": [""] * len(rows)}))
    commit.commit(run.stage_dir(iteration, "score"), w, {"stage": "score", "policy_version": iteration})


def _run_update(write_experiment, name: str, algorithm: dict | None = None, model: dict | None = None,
                **update) -> RunDir:
    from transformers import AutoTokenizer

    exp = config.load(write_experiment(name, update=update, run={"iterations": 1}, algorithm=algorithm or {},
                                       model=model or {}))
    run, _ = runs.prepare(exp, name)
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    job = executors.LocalExecutor(run, exp).submit("update", 0)
    job.job.results()  # raises with the stage's traceback if any rank failed
    assert commit.is_committed(run.stage_dir(0, "update"))
    return run


def _weights(run: RunDir) -> dict[str, torch.Tensor]:
    return load_file(run.stage_dir(0, "update") / "policy" / "model.safetensors")


def test_an_moe_update_records_routing_and_trains_the_routers_by_their_aux_loss(write_experiment, tiny_task,
                                                                                 tmp_path):
    """Every reward equal: no policy gradient, so the load-balancing loss alone moves weights: those
    the routers' inputs depend on, never the final norm, the head or the last layer's experts."""
    from transformers import AutoTokenizer

    from tests.conftest import load_tool

    model = load_tool("tiny_models").build("qwen3_moe", tmp_path / "moe", tiny_task / "model")
    exp = config.load(write_experiment("moe", model={"path": str(model)}, run={"iterations": 1},
                                       update={"moe_aux_loss_coef": 1.0}))
    run, _ = runs.prepare(exp, "moe")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path), reward=1.0)
    job = executors.LocalExecutor(run, exp).submit("update", 0).job
    job.results()
    assert "[update] iteration 0: step 2/2" in job.stdout()
    before, after = load_file(model / "model.safetensors"), _weights(run)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    downstream = {n for n in before
                  if n.startswith(("lm_head.", "model.norm.", "model.layers.1.mlp.experts."))}
    assert {f"model.layers.{i}.mlp.gate.weight" for i in range(2)} <= moved
    assert downstream and not moved & downstream and "model.embed_tokens.weight" in moved
    stats = pq.read_table(run.stage_dir(0, "update") / "stats.parquet").to_pylist()
    assert len(stats) == 2  # update.mini_batches
    for s in stats:
        load = np.array(s["expert_load"])
        assert load.shape == (2, 4) and np.allclose(load.mean(1), 1.0)  # layers x experts, even share 1
        assert s["moe_load_max"] == load.max() and s["moe_load_min"] == load.min()
    metrics = commit.read_manifest(run.stage_dir(0, "update"))["metrics"]
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/load_max"] >= 1 >= metrics["moe/load_min"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("one")

    def write(name, **sections):
        path = root / f"{name}.toml"
        path.write_text(c.experiment_toml(tiny_task, root / "runs", name, **sections))
        return path

    return _run_update(write, "one", zero_stage=2, world_size=1)


class ViewDumpingUpdate(executors.StageCall):
    """The update stage job, which also streams the policy's checkpoint view (what the resident
    sync sends: Actor.checkpoint_weights, under ZeRO-3 gathered layer by layer by every rank) after
    saving; rank 0 writes it beside the run as view.safetensors. Each rank writes the micro-batches
    of each optimizer step to micro-<rank>.txt: their number, rows and widest input."""

    def __call__(self) -> None:
        from safetensors.torch import save_file

        from hpcrl import trainer
        from hpcrl.actor import Actor

        step = trainer.step_micro_batches

        def counted(samples, mini, rank, *args):
            mbs = step(samples, mini, rank, *args)
            with open(f"{self.run_dir}/micro-{rank}.txt", "a") as f:
                f.write(f"{len(mbs)} {sum(len(mb.index) for mb in mbs)} "
                        f"{max(mb.input_ids.shape[1] for mb in mbs)}\n")
            return mbs

        trainer.step_micro_batches = counted

        save = Actor.save

        def save_and_dump(actor, ctx):
            save(actor, ctx)
            view = {name: t.detach().clone() for name, t in actor.checkpoint_weights()}
            if actor.rank == 0:
                save_file(view, str(ctx.run.root / "view.safetensors"))

        Actor.save = save_and_dump
        super().__call__()


@pytest.mark.parametrize(("zero_stage", "packed"), [(3, 0), (2, 40)], ids=["z3", "z2-packed"])
def test_two_ranks_match_one_rank_and_export_reloads_exactly(write_experiment, one_rank, zero_stage, packed,
                                                             monkeypatch):
    """Two ranks against one_rank; "packed": micro-batches of rows end to end up to 40 tokens
    (update.max_tokens_per_micro_batch), as many on both ranks, DeepSpeed told which ends each
    step. pins: packed micro-batches whose number DeepSpeed's accumulation count decides (a step
    taken early, or a gradient scaled by the wrong count), or ranks reducing gradients a different
    number of times."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(executors, "_calls", lambda run, exp, stage, it: [ViewDumpingUpdate(
        "stages.update", str(run.root), it)])
    packing = {"max_tokens_per_micro_batch": packed, "share_prompts": False} if packed else {}
    run = _run_update(write_experiment, f"z{zero_stage}-{packed}", zero_stage=zero_stage, world_size=2,
                      **packing)
    logs = [(run.root / f"micro-{r}.txt").read_text().splitlines() for r in range(2)]
    steps = [[[int(x) for x in line.split()] for line in log] for log in logs]
    assert [len(s) for s in steps] == [2, 2]  # one line per optimizer step and rank
    for mine, theirs in zip(*steps, strict=True):
        assert mine[0] == theirs[0]  # as many micro-batches on both ranks
        assert not packed or (mine[0] > 1 and mine[2] <= packed)
    # the sync's view of the sharded policy is exactly the saved checkpoint
    view = load_file(run.root / "view.safetensors")
    assert view.keys() == _weights(run).keys()
    assert all(torch.equal(view[k], v) for k, v in _weights(run).items())
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    assert len(stats) == 2 and all(s["grad_norm"] > 0 for s in stats)  # 2 mini-batches, real gradients
    two, one = _weights(run), _weights(one_rank)
    base = load_file(run.policy_dir(0, config.load(run.config_path).model.path) / "model.safetensors")
    assert any(not torch.equal(two[k], base[k]) for k in two)  # the update changed the policy
    # the token-mean loss does not depend on how the batch is split over ranks: same loss and
    # gradient norm; weights equal up to Adam's amplification of float noise in near-zero gradients
    ref_stats = commit.read_table(one_rank.stage_dir(0, "update"), "stats").to_pylist()
    for a, b in zip(stats, ref_stats, strict=True):
        assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    lr = config.load(run.config_path).update.lr
    diffs = torch.cat([(two[k] - one[k]).abs().flatten() for k in one])
    assert diffs.max() < 0.5 * lr and diffs.mean() < 1e-3 * lr
    # the exported HF weights are exactly the DeepSpeed state's fp32 weights
    trainer_state = get_fp32_state_dict_from_zero_checkpoint(str(run.stage_dir(0, "update") / "trainer"),
                                                             tag="state")
    model = AutoModelForCausalLM.from_pretrained(run.stage_dir(0, "update") / "policy", dtype=torch.float32)
    reloaded = model.state_dict()
    for k, v in trainer_state.items():
        assert torch.equal(reloaded[k], v), k


def test_shared_prompts_update_the_policy_as_whole_rows_do(write_experiment, one_rank):
    """update.share_prompts (the default, in one_rank) against every row run whole, with each layer
    recomputed in the backward pass (update.gradient_checkpointing): the same update."""
    run = _run_update(write_experiment, "whole", zero_stage=2, world_size=1, share_prompts=False,
                      gradient_checkpointing=True)
    notes = [commit.read_manifest(r.stage_dir(0, "update"))["notes"]["gradient_checkpointing"]
             for r in (run, one_rank)]
    assert notes == ["true", "false"]
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    shared = commit.read_table(one_rank.stage_dir(0, "update"), "stats").to_pylist()
    for a, b in zip(stats, shared, strict=True):
        assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["tokens"] == b["tokens"]
    old = commit.read_table(run.stage_dir(0, "update"), "advantages")["old_logprobs"].to_pylist()
    old_shared = commit.read_table(one_rank.stage_dir(0, "update"), "advantages")["old_logprobs"].to_pylist()
    np.testing.assert_allclose(np.concatenate(old), np.concatenate(old_shared), atol=2e-5)
    lr = config.load(run.config_path).update.lr
    diffs = torch.cat([(w - _weights(one_rank)[k]).abs().flatten() for k, w in _weights(run).items()])
    assert diffs.max() < 0.5 * lr and diffs.mean() < 1e-3 * lr


@pytest.mark.parametrize(("offload", "zero_stage"), [("optimizer", 2), ("all", 3)])
def test_an_offloaded_update_is_the_plain_update(write_experiment, one_rank, offload, zero_stage):
    """update.offload (DeepSpeed's ZeRO-Offload: the optimizer state, with "all" the parameters too,
    in CPU memory, stepped by the same AdamW) against the plain update of one_rank. pins: a setting
    that never reaches DeepSpeed's config, or an offloaded step that is another optimizer's."""
    run = _run_update(write_experiment, f"offload-{offload}", zero_stage=zero_stage, world_size=1,
                      offload=offload)
    assert [commit.read_manifest(r.stage_dir(0, "update"))["notes"]["offload"]
            for r in (run, one_rank)] == [offload, "none"]
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    plain = commit.read_table(one_rank.stage_dir(0, "update"), "stats").to_pylist()
    for a, b in zip(stats, plain, strict=True):
        assert a["pg_loss"] == pytest.approx(b["pg_loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    lr = config.load(run.config_path).update.lr
    diffs = torch.cat([(w - _weights(one_rank)[k]).abs().flatten() for k, w in _weights(run).items()])
    assert diffs.max() < 0.5 * lr and diffs.mean() < 1e-3 * lr


def test_update_records_advantages_and_logprob_mismatch(one_rank):
    d = one_rank.stage_dir(0, "update")
    m = commit.read_manifest(d)
    adv = commit.read_table(d, "advantages")
    assert adv.num_rows == 32
    groups = {}
    for row in adv.to_pylist():
        groups.setdefault(row["prompt_index"], []).append(row["advantage"])
    assert all(abs(sum(g)) < 1e-4 for g in groups.values())  # group-centred
    # the sampler's logprobs are the policy's own (computed by the fixture outside DeepSpeed): the
    # recorded mismatch is float rounding, and the trainer's attention implementation is on record
    assert 0 < m["metrics"]["rollout/logprob_diff_mean"] < 1e-5
    assert m["metrics"]["rollout/logprob_diff_max"] < 1e-4 and abs(m["metrics"]["rollout/sampler_kl"]) < 1e-8
    assert m["notes"] == {"attn_implementation": "sdpa", "gradient_checkpointing": "false", "offload": "none"}
    assert m["policy_version"] == 1 and m["inputs"]


def test_old_logprobs_are_the_sampled_policy_s_in_every_mini_batch(one_rank):
    """The first mini-batch's old logprobs come from its own training forward pass, the others'
    from a pass before the first step: all are the base policy's, none the stepped policy's."""
    from transformers import AutoModelForCausalLM

    exp = config.load(one_rank.config_path)
    base = AutoModelForCausalLM.from_pretrained(one_rank.policy_dir(0, exp.model.path),
                                                dtype=torch.float32).eval()
    rollouts = {(r["prompt_index"], r["sample_index"]): r
                for r in commit.read_table(one_rank.stage_dir(0, "generate"), "rollouts").to_pylist()}
    rows = commit.read_table(one_rank.stage_dir(0, "update"), "advantages").to_pylist()
    for row in rows:
        r = rollouts[(row["prompt_index"], row["sample_index"])]
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(base(input_ids=ids).logits[0, :-1].float(), -1)
        want = lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(r["prompt_ids"]) - 1:].tolist()
        assert row["old_logprobs"] == pytest.approx(want, abs=2e-5), \
            (row["prompt_index"], row["sample_index"])
    stats = commit.read_table(one_rank.stage_dir(0, "update"), "stats").to_pylist()
    assert stats[0]["ppo_kl"] == 0 and stats[0]["pg_clipfrac"] == 0  # the first step is exactly on-policy
    assert abs(stats[1]["ppo_kl"]) > 0  # the second sees the policy after the first step


def test_committed_update_is_not_run_again(one_rank):
    before = (one_rank.stage_dir(0, "update") / "_COMMIT.json").read_bytes()
    exp = config.load(one_rank.config_path)
    executors.LocalExecutor(one_rank, exp).submit("update", 0).job.results()
    assert (one_rank.stage_dir(0, "update") / "_COMMIT.json").read_bytes() == before


def test_kl_penalty_to_the_reference_policy(write_experiment):
    exp_kl = {"kl": {"coef": 0.1, "estimator": "k3"}}
    from transformers import AutoTokenizer

    exp = config.load(write_experiment("kl", algorithm=exp_kl, run={"iterations": 1}))
    run, _ = runs.prepare(exp, "kl")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    executors.LocalExecutor(run, exp).submit("update", 0).job.results()
    d = run.stage_dir(0, "update")
    adv = commit.read_table(d, "advantages").to_pylist()
    # at iteration 0 the policy is the reference: both logprob recomputations agree
    for row in adv:
        assert row["ref_logprobs"] is not None
        np.testing.assert_allclose(row["ref_logprobs"], row["old_logprobs"], atol=1e-6)
    stats = commit.read_table(d, "stats").to_pylist()
    assert stats[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # before any step
    assert stats[1]["kl_ref"] > 0  # the first step moved the policy away from the reference
    # the KL is in the loss: the first mini-batch's old logprobs are its own forward pass's (the
    # ratio is exactly 1), and the batch's KL to the reference is priced after that step
    assert stats[0]["ppo_kl"] == 0 and stats[0]["pg_clipfrac"] == 0
    metrics = commit.read_manifest(d)["metrics"]
    assert metrics["actor/kl_loss"] > 0 and metrics["critic/kl_coef"] == pytest.approx(0.1)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # old (v0) against ref (v0)
    record = json.loads((d / "kl_control.json").read_text())
    assert record["kl_coef"] == record["next_kl_coef"] == pytest.approx(0.1)


def test_update_with_rloo_seq_mean_aggregation_clip_variants_and_entropy_bonus(write_experiment):
    from transformers import AutoTokenizer

    from hpcrl import advantages

    algo = {"name": "rloo", "loss_agg": "seq-mean-token-sum", "clip_ratio_high": 0.28, "dual_clip_c": 3.0,
            "entropy_coef": 0.01}
    exp = config.load(write_experiment("rloo", algorithm=algo, run={"iterations": 1}))
    run, _ = runs.prepare(exp, "rloo")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    executors.LocalExecutor(run, exp).submit("update", 0).job.results()
    d = run.stage_dir(0, "update")
    adv = commit.read_table(d, "advantages")
    rewards = commit.read_table(run.stage_dir(0, "score"), "scores")["reward"].to_numpy()
    expected = advantages.rloo(torch.tensor(rewards), torch.tensor(adv["prompt_index"].to_numpy()))
    np.testing.assert_allclose(adv["advantage"].to_numpy(), expected.numpy(), rtol=1e-6)
    stats = commit.read_table(d, "stats").to_pylist()
    assert all(s["grad_norm"] > 0 for s in stats)


PPO = {"name": "ppo", "critic": {"gamma": 1.0, "lam": 0.95, "lr": 1e-3, "value_clip": 0.2},
       "kl": {"mode": "reward", "estimator": "k1", "coef": 0.05, "target": 1.0, "horizon": 100.0}}


def _run_ppo_update(write_experiment, name: str, **update) -> RunDir:
    from transformers import AutoTokenizer

    exp = config.load(write_experiment(name, algorithm=PPO, update=update, run={"iterations": 1}))
    run, _ = runs.prepare(exp, name)
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    executors.LocalExecutor(run, exp).submit("update", 0).job.results()
    return run


@pytest.mark.parametrize("split", ["zero3", "sp2-packed"])
def test_ppo_critic_update_is_the_same_on_one_and_two_ranks(write_experiment, split):
    """PPO's critic and GAE on 1 rank (ZeRO-2) and 2 ranks: ZeRO-3, or one sequence-parallel group
    of 2 (update.sequence_parallel, packed rows): same values, returns, losses. pins (sp2-packed):
    a value model whose training pass does not split sequences (DeepSpeed's shapes assert), values
    gathered out of alignment, or the critic's statistics counted once per rank of the group."""
    from hpcrl.critic import HEAD_FILE, load_value_model

    one = _run_ppo_update(write_experiment, "ppo1", zero_stage=2, world_size=1)
    two = _run_ppo_update(write_experiment, "ppo2", zero_stage=3, world_size=2) if split == "zero3" else \
        _run_ppo_update(write_experiment, "ppo-sp", zero_stage=2, world_size=2, sequence_parallel=2,
                        share_prompts=False, max_tokens_per_micro_batch=40)
    d1, d2 = one.stage_dir(0, "update"), two.stage_dir(0, "update")
    a1, a2 = commit.read_table(d1, "advantages").to_pylist(), commit.read_table(d2, "advantages").to_pylist()
    for x, y in zip(a1, a2, strict=True):
        assert x["values"] == y["values"] and not any(x["values"])  # the new value head is zero
        np.testing.assert_allclose(x["returns"], y["returns"], atol=1e-6)
        np.testing.assert_allclose(x["token_advantages"], y["token_advantages"], atol=1e-5)
        assert len(x["token_advantages"]) == len(x["old_logprobs"]) == len(x["returns"])
    s1, s2 = commit.read_table(d1, "stats").to_pylist(), commit.read_table(d2, "stats").to_pylist()
    for x, y in zip(s1, s2, strict=True):
        assert x["vf_loss"] == pytest.approx(y["vf_loss"], rel=1e-5)
        assert x["vf_grad_norm"] == pytest.approx(y["vf_grad_norm"], rel=1e-4)
        # pg_loss is a mean of O(1) terms that nearly cancel (normalised advantages): float32 rounding
        # in another summation order is ~1e-7 of the terms, not of the small result
        assert x["pg_loss"] == pytest.approx(y["pg_loss"], rel=1e-5, abs=1e-6)
        assert x["vf_grad_norm"] > 0 and x["grad_norm"] > 0
    m1, m2 = commit.read_manifest(d1)["metrics"], commit.read_manifest(d2)["metrics"]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                "critic/kl_coef", "actor/reward_kl_penalty"):
        assert np.isfinite(m1[key]), key
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-7), key
    assert m1["critic/explained_variance"] == 0.0  # the zero value head predicts 0 for every token
    assert m1["critic/kl_coef"] == 0.05  # the controller's initial value
    # the saved critics (ZeRO-2 on 1 rank, consolidated ZeRO-3 on 2) agree and moved from the zero head
    c1, c2 = (load_value_model(d / "critic", torch.float32) for d in (d1, d2))
    w1, w2 = c1.state_dict(), c2.state_dict()
    assert w1["value_head.weight"].abs().sum() > 0
    diffs = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
    assert diffs.max() < 0.5 * PPO["critic"]["lr"]
    for d in (d1, d2):
        assert (d / "critic" / HEAD_FILE).is_file() and (d / "critic" / "config.json").is_file()
        assert (d / "trainer" / "critic" / "latest").is_file()
        assert "critic/value_head.safetensors" in commit.read_manifest(d)["files"]  # checksummed
        assert (d / "kl_control.json").is_file()


def test_old_logprobs_from_the_sampler_skip_the_recompute(write_experiment):
    from transformers import AutoTokenizer

    exp = config.load(write_experiment("sampler-old", algorithm={"old_logprobs": "sampler"},
                                       run={"iterations": 1}))
    run, _ = runs.prepare(exp, "sampler-old")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path), sampler_logprob=-1.0)
    executors.LocalExecutor(run, exp).submit("update", 0).job.results()
    d = run.stage_dir(0, "update")
    rollouts = {(r["prompt_index"], r["sample_index"]): r["logprobs"]
                for r in commit.read_table(run.stage_dir(0, "generate"), "rollouts").to_pylist()
                if r["split"] == "train"}
    for row in commit.read_table(d, "advantages").to_pylist():
        assert row["old_logprobs"] == pytest.approx(rollouts[(row["prompt_index"], row["sample_index"])])
    # the sampler's logprobs (-1.0 for every token) are far from the policy's: the ratio sees it
    stats = commit.read_table(d, "stats").to_pylist()
    assert stats[0]["ppo_kl"] < -0.01 and stats[0]["pg_clipfrac"] > 0


def test_an_update_whose_trainer_disagrees_with_the_sampler_stops_uncommitted(write_experiment):
    """The staged mode's check that the trainer computes the model that sampled (hpcrl.agreement),
    made at the first optimizer step: the update's other steps are never taken."""
    from transformers import AutoTokenizer

    exp = config.load(write_experiment("disagree", run={"iterations": 1}))
    run, _ = runs.prepare(exp, "disagree")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path), sampler_logprob=-1.0)
    job = executors.LocalExecutor(run, exp).submit("update", 0).job
    with pytest.raises(Exception, match=r"ModelMismatchError: iteration 0: the trainer's logprobs of the "
                                        r"sampled tokens differ from vLLM's by \S+ on average"):
        job.results()
    assert not commit.is_committed(run.stage_dir(0, "update"))
    assert "[update] iteration 0: step" not in job.stdout()  # no step finished (each prints a line)


class HookedUpdate(executors.StageCall):
    """The update stage job with an `after_compute` hook (the resident trainers send the weights
    there) that prints which of the update's tables are written when it runs."""

    def __call__(self) -> None:
        from hpcrl.update import UpdateStage

        def hook() -> None:
            update_dir = RunDir.at(self.run_dir).stage_dir(self.iteration, "update")
            written = sorted(p.name for p in commit.temp_dir(update_dir).rglob("*.parquet"))
            print(f"after_compute: written {written}", flush=True)

        UpdateStage.after_compute = staticmethod(hook)
        super().__call__()


class AheadUpdate(executors.StageCall):
    """The update stage job that first computes what the update needs no scores for
    (hpcrl.update_ahead), as the resident trainers do while the generator scores."""

    def __call__(self) -> None:
        from hpcrl.update import UpdateStage

        run = UpdateStage.run

        def run_prepared(stage, ctx, guard=None):
            stage.prepare(ctx.iteration)
            return run(stage, ctx, guard)

        UpdateStage.run = run_prepared
        super().__call__()


def test_an_update_computed_partly_ahead_commits_what_the_whole_update_does(write_experiment):
    """pins: the old and reference logprobs computed ahead (hpcrl.update_ahead) for other rows, under
    other weights or in another order than the update's own; the update then ignoring them."""
    import submitit
    from transformers import AutoTokenizer

    out = {}
    for name in ("whole", "ahead"):
        exp = config.load(write_experiment(name, algorithm={"kl": {"coef": 0.1, "estimator": "k3"}},
                                           run={"iterations": 1}))
        run, _ = runs.prepare(exp, name)
        _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
        if name == "whole":
            executors.LocalExecutor(run, exp).submit("update", 0).job.results()
        else:
            submitit.LocalExecutor(folder=run.logs / "%j").submit(AheadUpdate("stages.update", str(run.root),
                                                                              0)).result()
        d = run.stage_dir(0, "update")
        out[name] = ([commit.read_table(d, t) for t in ("stats", "advantages")], _weights(run),
                     commit.read_manifest(d)["timings"])
    (tables, weights, timings), (tables_ahead, weights_ahead, timings_ahead) = out["whole"], out["ahead"]
    assert all(a.equals(b) for a, b in zip(tables, tables_ahead, strict=True))
    assert all(torch.equal(weights[n], weights_ahead[n]) for n in weights)
    assert "prepare" not in timings and timings_ahead["prepare"] > 0


class PoisonedUpdate(HookedUpdate):
    """The update stage job with a fault injected: after the (last) optimizer step one weight of the
    policy is set to NaN (what an overflowing step or a bad kernel leaves behind)."""

    def __call__(self) -> None:
        from hpcrl import trainer

        step = trainer.engine_step

        def poisoned(engine):
            boundary = engine.is_gradient_accumulation_boundary()
            norm = step(engine)
            if boundary:  # after the optimizer step
                with torch.no_grad():
                    next(engine.module.parameters()).view(-1)[0] = float("nan")
            return norm

        trainer.engine_step = poisoned
        super().__call__()


def test_an_update_that_goes_non_finite_commits_nothing(write_experiment):
    """Pins: a non-finite policy committed (and then served). The update refuses before writing
    anything, says why, and leaves the stage uncommitted."""
    import submitit
    from transformers import AutoTokenizer

    exp = config.load(write_experiment("nan", update={"mini_batches": 1}, run={"iterations": 1}))
    run, _ = runs.prepare(exp, "nan")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    local = submitit.LocalExecutor(folder=run.logs / "%j")
    job = local.submit(PoisonedUpdate("stages.update", str(run.root), 0))
    with pytest.raises(Exception, match="FloatingPointError: the update of iteration 0 produced 1 non-finite "
                                        "parameter tensor\\(s\\) in the trainer; nothing is committed and "
                                        "the run stays at policy version 0"):
        job.result()
    assert not commit.is_committed(run.stage_dir(0, "update"))
    assert not (run.stage_dir(0, "update") / "policy").exists()
    assert "after_compute" not in job.stdout()  # no weights of it are sent either


def test_the_weights_are_handed_over_after_the_steps_and_before_the_writes(write_experiment):
    """`after_compute`, where the resident trainers send an update's weights, runs once every step
    has ended, before any table of the update is written; the update then commits as usual."""
    import submitit
    from transformers import AutoTokenizer

    exp = config.load(write_experiment("hooked", run={"iterations": 1}))
    run, _ = runs.prepare(exp, "hooked")
    _commit_inputs(run, exp, AutoTokenizer.from_pretrained(exp.model.path))
    local = submitit.LocalExecutor(folder=run.logs / "%j")
    job = local.submit(HookedUpdate("stages.update", str(run.root), 0))
    job.result()
    out = job.stdout()
    steps = exp.update.ppo_epochs * exp.update.mini_batches
    assert out.index(f"step {steps}/{steps}") < out.index("after_compute: written []")
    assert commit.read_table(run.stage_dir(0, "update"), "stats").num_rows == steps


def test_a_bf16_update_keeps_fp32_master_weights_and_gradients(write_experiment):
    """Issue #17 defect 11: bf16 ran DeepSpeed's stage 0 on one rank (no fp32 master weights) and
    accumulated gradients in bf16. Now: its bf16 optimizer (stage 1), fp32 accumulation; a real
    one-rank bf16 update runs with it and moves the policy."""
    from hpcrl import trainer

    exp = config.load(write_experiment("bf16", model={"dtype": "bfloat16"}))
    ds = trainer.ds_config(exp, 1, 1)
    assert ds["zero_optimization"]["stage"] == 1 and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert trainer.zero_stage(exp, 2) == 2  # update.zero_stage over several ranks, as configured
    run = _run_update(write_experiment, "bf16run", model={"dtype": "bfloat16"}, sampler_mismatch_tol=1.0)
    stats = commit.read_table(run.stage_dir(0, "update"), "stats").to_pylist()
    assert all(s["grad_norm"] > 0 for s in stats)
    base = load_file(run.policy_dir(0, config.load(run.config_path).model.path) / "model.safetensors")
    assert any(not torch.equal(v.float(), base[k].float()) for k, v in _weights(run).items())


def test_a_policy_saved_from_gpu_memory_keeps_its_tied_weights_tied(tiny_task, monkeypatch, tmp_path):
    """Found on an H200: the policy of an update on the GPU held 27 tensors, the same update's on a
    CPU 26, as moving the state dict to CPU memory entry by entry copied the tied embedding and
    lm_head.weight apart (save_pretrained keeps one of a tied pair only when they share memory).
    A GPU tensor's `.cpu()` (a copy) is stood in for here."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hpcrl import trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_task / "model")
    state = model.state_dict()
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *args, **kwargs: self.clone())
    moved = trainer.to_cpu(state)
    assert moved["lm_head.weight"] is moved["model.embed_tokens.weight"]
    assert torch.equal(moved["lm_head.weight"], state["model.embed_tokens.weight"])
    assert len({id(t) for t in moved.values()}) == len(state) - 1  # only the tied pair shares
    model.save_pretrained(tmp_path, state_dict=moved, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert "lm_head.weight" not in saved.keys() and len(saved.keys()) == len(state) - 1
