"""The trainer-sampler agreement checks (hpcrl.agreement) on hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from hpcrl import agreement


def test_sampler_mismatch_is_the_mean_and_largest_difference_and_the_k3_kl():
    old = {0: [-1.0, -2.0], 1: [-0.5]}
    sampler = [[-1.1, -2.0], [-0.3]]
    m = agreement.sampler_mismatch(old, sampler)
    # log ratios trainer - sampler: 0.1, 0, -0.2
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.1)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.2)
    k3 = [math.exp(r) - 1 - r for r in (0.1, 0.0, -0.2)]
    assert m["rollout/sampler_kl"] == pytest.approx(sum(k3) / 3)
    assert agreement.sampler_mismatch({0: []}, [[]])["rollout/sampler_kl"] == 0.0


def test_an_update_beyond_the_tolerance_stops_and_names_the_cause():
    m = agreement.sampler_mismatch({0: [-1.0, -2.0]}, [[-1.0, -2.0017]])
    agreement.check_sampler(m, 1e-3, iteration=0)  # 8.5e-4: within
    with pytest.raises(agreement.ModelMismatchError,
                       match=r"iteration 4: .* by 8.50e-04 on average \(largest 1.70e-03, KL .*above "
                             r"update.sampler_mismatch_tol = 5e-04.*attention implementation"):
        agreement.check_sampler(m, 5e-4, iteration=4)
    nan = agreement.sampler_mismatch({0: [float("nan")]}, [[-1.0]])
    with pytest.raises(agreement.ModelMismatchError):
        agreement.check_sampler(nan, 1.0, iteration=0)


def test_tolerances_by_dtype_unless_set():
    assert agreement.sampler_tolerance(0.0, "float32") == 1e-3
    assert agreement.sampler_tolerance(0.0, "bfloat16") == 5e-2
    assert agreement.sampler_tolerance(0.2, "float32") == 0.2


def test_a_run_whose_trainer_and_sampler_disagree_at_the_start_is_refused_with_both_numbers():
    engine, trainer = [[-1.0, -2.0], [-3.0]], [[-1.0, -2.003], [-3.0]]
    ok = agreement.check_start(engine, [[-1.0, -2.00001], [-3.0]], 1e-4, "sdpa", "m")
    assert ok["sync/start_logp_diff"] == pytest.approx(1e-5 / 3)
    with pytest.raises(agreement.ModelMismatchError,
                       match=r"/models/g2: before any update, .* by 1.00e-03 on average "
                             r"\(largest 3.00e-03\), above the tolerance 1e-04 "
                             r".*attention implementation 'sdpa'"):
        agreement.check_start(engine, trainer, 1e-4, "sdpa", "/models/g2")
