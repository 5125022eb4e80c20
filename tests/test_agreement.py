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


def test_an_empty_batch_or_probe_gives_zero_statistics_and_passes():
    """Pins the no-token case (a batch whose responses are all empty, a probe without sequences):
    every statistic is exactly 0 under its own name (not a missing key, a 1.0, or numpy's
    error on concatenating nothing or taking the max of nothing), and both checks pass it."""
    zeros = {"rollout/logprob_diff_mean": 0.0, "rollout/logprob_diff_max": 0.0, "rollout/sampler_kl": 0.0}
    assert agreement.sampler_mismatch({}, []) == zeros  # no rows at all
    assert agreement.sampler_mismatch({0: [], 1: []}, [[], []]) == zeros  # rows without tokens
    agreement.check_sampler(zeros, 1e-3, iteration=0)
    assert agreement.check_start([], [], 1e-4, "sdpa", "m") == {"sync/start_logp_diff": 0.0,
                                                                "sync/start_logp_diff_max": 0.0}
    assert agreement.check_start([[]], [[]], 1e-4, "sdpa", "m") == {"sync/start_logp_diff": 0.0,
                                                                    "sync/start_logp_diff_max": 0.0}


def test_the_start_check_returns_the_mean_and_the_largest_difference_under_their_names():
    """Pins the start check's metrics: the mean |difference| and the largest one, each under its
    own sync/* name (a renamed or swapped key reaches the tracker as another metric)."""
    engine, trainer = [[-1.0, -2.0], [-3.0]], [[-1.25, -2.0], [-2.5]]  # |d| = 0.25, 0, 0.5
    assert agreement.check_start(engine, trainer, 0.5, "sdpa", "m") == {
        "sync/start_logp_diff": 0.25, "sync/start_logp_diff_max": 0.5}


def test_a_difference_exactly_at_the_tolerance_passes_and_just_above_it_stops():
    """Pins the tolerance as inclusive in both checks (`<=`, not `<`): a mean |difference| equal to
    the tolerance passes (values exact in binary: 0.25 and 0.5), the next float above it stops."""
    at = agreement.check_start([[-1.0, -2.0]], [[-1.5, -2.0]], 0.25, "sdpa", "m")
    assert at["sync/start_logp_diff"] == 0.25
    with pytest.raises(agreement.ModelMismatchError, match="above the tolerance"):
        agreement.check_start([[-1.0, -2.0]], [[-1.5, -2.0]], math.nextafter(0.25, 0.0), "sdpa", "m")
    m = agreement.sampler_mismatch({0: [-1.0, -2.0]}, [[-1.5, -2.0]])
    assert m["rollout/logprob_diff_mean"] == 0.25
    agreement.check_sampler(m, 0.25, iteration=1)
    with pytest.raises(agreement.ModelMismatchError, match="iteration 1: "):
        agreement.check_sampler(m, math.nextafter(0.25, 0.0), iteration=1)


def test_a_probe_answer_with_a_sequence_missing_is_refused_not_compared_on_the_rest():
    """Pins the row count: an engine's answer that lacks a probe sequence (or has one more) must
    fail, not be compared on the rows both have (a truncating zip would pass a partial answer)."""
    engine, trainer = [[-1.0, -2.0], [-3.0]], [[-1.0, -2.0]]
    with pytest.raises(ValueError):
        agreement.check_start(engine, trainer, 1e-4, "sdpa", "m")
    with pytest.raises(ValueError):
        agreement.check_start(trainer, engine, 1e-4, "sdpa", "m")


def test_a_non_finite_start_probe_is_refused():
    """Pins the start check's finiteness test: a NaN or infinite difference must refuse the run
    (NaN <= tol is false, but an `or` in place of the `and`, or a dropped `not`, would pass it)."""
    for bad in (float("nan"), float("-inf")):
        with pytest.raises(agreement.ModelMismatchError, match="m: before any update"):
            agreement.check_start([[bad, -2.0]], [[-1.0, -2.0]], 1.0, "sdpa", "m")
    inf = agreement.sampler_mismatch({0: [float("-inf")]}, [[-1.0]])
    with pytest.raises(agreement.ModelMismatchError, match="iteration 3: .* by inf on average"):
        agreement.check_sampler(inf, 1.0, iteration=3)


def test_the_sampler_statistics_of_several_rows_against_numpy():
    """Pins `sampler_mismatch` on rows of several lengths, taken in row order from `old` by index
    (the trainer's dict may hold its rows in any order) against the sampler's list: the mean and
    largest |log ratio| and the k3 KL estimate mean(exp(r) - 1 - r), with r = trainer - sampler
    (the sign matters for the KL: k3 is not symmetric in r)."""
    import numpy as np

    old = {2: [-0.7], 0: [-1.0, -0.2, -3.0], 1: [-2.5, -0.1]}  # gathered out of order
    sampler = [[-1.3, -0.2, -2.0], [-2.0, -0.4], [-0.7]]
    r = np.array([0.3, 0.0, -1.0, -0.5, 0.3, 0.0])
    m = agreement.sampler_mismatch(old, sampler)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(np.abs(r).mean(), rel=1e-12)
    assert m["rollout/logprob_diff_max"] == pytest.approx(1.0, rel=1e-12)
    assert m["rollout/sampler_kl"] == pytest.approx(np.mean(np.exp(r) - 1 - r), rel=1e-12)
    flipped = agreement.sampler_mismatch({0: [-1.0]}, [[-2.0]])["rollout/sampler_kl"]  # r = +1
    assert flipped == pytest.approx(math.e - 2) and flipped != pytest.approx(math.exp(-1))


def test_rows_of_different_lengths_are_refused_not_broadcast():
    """pins: numpy broadcasting a one-token row against a longer one (the difference of every
    token from the one logprob), which would compare logprobs of different tokens silently."""
    from hpcrl import agreement

    with pytest.raises(agreement.ModelMismatchError, match="row 1: 1 logprobs on one side, 3 on the other"):
        agreement.check_start([[-1.0], [-0.5]], [[-1.0], [-0.5, -0.6, -0.7]], 1e-3, "sdpa", "m")
