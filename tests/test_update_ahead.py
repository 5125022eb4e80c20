"""What an update computes before its first step, and when a computation of it ahead applies
(hpcrl.update_ahead); that the update computed partly ahead commits what the whole one does is in
tests/test_update_deepspeed.py, and that resident updates use it in tests/test_resident.py."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from hpcrl import update_ahead as ahead


def _actor(old_logprobs="recompute", critic=None, warmup=0, ref=None, kl_mode="loss"):
    algorithm = SimpleNamespace(old_logprobs=old_logprobs, critic=SimpleNamespace(warmup=warmup),
                                kl=SimpleNamespace(mode=kl_mode))
    return SimpleNamespace(exp=SimpleNamespace(algorithm=algorithm), critic=critic, ref_model=ref)


def test_the_first_mini_batch_owns_its_old_logprobs_only_when_its_step_trains_the_policy():
    assert ahead.owns_old(_actor(), 0)
    assert not ahead.owns_old(_actor(old_logprobs="sampler"), 0)
    assert not ahead.owns_old(_actor(critic=object(), warmup=2), 1)  # the critic trains alone first
    assert ahead.owns_old(_actor(critic=object(), warmup=2), 2)
    assert ahead.owns_old(_actor(ref=object()), 0)  # a KL in the loss is priced after the first step
    assert not ahead.owns_old(_actor(ref=object(), kl_mode="reward"), 0)  # GAE needs it before


def test_the_steps_cover_each_epoch_s_groups_in_a_seeded_order():
    exp = SimpleNamespace(update=SimpleNamespace(ppo_epochs=2, mini_batches=2))
    groups = [g for g in range(4) for _ in range(3)]
    steps = ahead.steps(exp, groups, seed=5)
    assert [e for e, _ in steps] == [0, 0, 1, 1]
    for epoch in (0, 1):
        rows = sorted(r for e, mini in steps if e == epoch for r in mini)
        assert rows == list(range(12))
    assert steps == ahead.steps(exp, groups, seed=5) and steps != ahead.steps(exp, groups, seed=6)


def test_an_update_takes_only_what_was_computed_ahead_for_it_from_its_generation():
    keys = pa.table({"split": ["train"], "prompt_index": [0], "sample_index": [0]})
    prepared = ahead.Prepared(3, "sha256:a", keys, keys, {}, None, 0.5)
    assert ahead.of_update(prepared, 3, "sha256:a") is prepared
    assert ahead.of_update(prepared, 4, "sha256:a") is None  # another update's
    assert ahead.of_update(prepared, 3, "sha256:b") is None  # generation 3 made again since
    assert ahead.of_update(None, 3, "sha256:a") is None


class _Actor:
    """The actor's calls `prepare` makes, recorded (with the batch's responses): each row's logprobs
    are [row] (the policy's) or [-row] (the reference's); one rank."""

    def __init__(self, old_logprobs="recompute", ref=False, mini_batches=2, kl_mode="loss", critic=False):
        self.exp = SimpleNamespace(algorithm=SimpleNamespace(old_logprobs=old_logprobs,
                                                             critic=SimpleNamespace(warmup=5),
                                                             kl=SimpleNamespace(mode=kl_mode)),
                                   update=SimpleNamespace(ppo_epochs=1, mini_batches=mini_batches),
                                   run=SimpleNamespace(seed=4))
        self.critic, self.ref_model, self.calls = object() if critic else None, object() if ref else None, []

    def data_rows(self, rows):
        return rows

    def logprobs(self, samples, rows):
        self.calls.append(("policy", rows, samples.response_ids))
        return {r: [float(r)] for r in rows}

    def ref_logprobs(self, samples, rows):
        self.calls.append(("reference", rows, samples.response_ids))
        return {r: [-float(r)] for r in rows}


def _committed_generation(tmp_path, k: int):
    import pyarrow.parquet as pq

    from hpcrl import commit
    from hpcrl.rundir import RunDir
    from tests.test_batches import _tables

    run = RunDir.at(tmp_path)
    w = commit.StageWriter(commit.fresh_temp_dir(run.stage_dir(k, "generate")))
    pq.write_table(_tables()[0], w.dir / "rollouts.parquet")  # the columns the update reads
    w.tables["rollouts"] = {"file": "rollouts.parquet", "rows": 7, "schema": "rollouts"}
    commit.commit(run.stage_dir(k, "generate"), w, {"stage": "generate", "policy_version": k})
    return run


def test_prepare_computes_the_rows_the_update_would_before_its_first_step(tmp_path):
    """pins (prepare, logprobs_before_steps): the rows of each forward pass (all but the first
    mini-batch's, whose step computes its own: with run seed 4 and update 2 that is row 1; a seed
    derived without the run's seed, the update's iteration or the stage's name puts row 0 first), the
    batch they are of, the reference's rows, what a run without either computes, the record."""
    from hpcrl import commit
    from hpcrl.stage import derive_seed

    run = _committed_generation(tmp_path, 2)
    responses = [[9], [11, 12], [14, 15, 16]]  # the kept training rows (tests/test_batches.py)
    actor = _Actor(ref=True)
    assert ahead.steps(actor.exp, [7, 3, 7], derive_seed(4, 2, "update"))[0][1] == [1]
    p = ahead.prepare(actor, run, 2)
    assert actor.calls == [("policy", [0, 2], responses), ("reference", [0, 1, 2], responses)]
    assert p.old == {0: [0.0], 2: [2.0]} and p.ref == {0: [-0.0], 1: [-1.0], 2: [-2.0]}
    assert (p.iteration, p.generation) == (2, commit.manifest_digest(run.stage_dir(2, "generate")))
    assert p.keys.to_pydict()["prompt_index"] == [7, 3, 7] and p.rollouts.num_rows == 7
    assert 0 <= p.seconds < 60
    sampler = _Actor(old_logprobs="sampler")
    p = ahead.prepare(sampler, run, 2)
    assert p.old is None and p.ref is None and sampler.calls == []
    # no step computes old logprobs of its own: the policy's forward passes cover every row
    for actor in (_Actor(ref=True, kl_mode="reward"), _Actor(critic=True)):  # GAE prices the KL; warmup
        ahead.prepare(actor, run, 2)
        assert actor.calls[0] == ("policy", [0, 1, 2], responses)
