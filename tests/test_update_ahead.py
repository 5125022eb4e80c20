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
