"""tools/critic_ceiling.py: the true value of a response prefix under exact match, worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import load_tool


def ceiling():
    return load_tool("critic_ceiling")


class FixedModel:
    """A causal LM whose next-token distribution depends only on the position: probs[position]."""

    def __init__(self, probs: list[list[float]]):
        self.logits = torch.log(torch.tensor(probs, dtype=torch.float64))

    def __call__(self, input_ids: torch.Tensor):
        n = input_ids.shape[1]
        return SimpleNamespace(logits=self.logits[:n].unsqueeze(0))


def test_oracle_values_by_hand():
    # vocabulary {0, 1, 2 = EOS}; prompt [0, 0] (positions 0-1), answer [1, 1] + EOS (positions 2-4)
    # the answer's tokens come with p = 0.9 (position 1 predicts token 1), 0.8 (position 2), 0.5 (EOS at 3)
    probs = [[1 / 3] * 3, [0.05, 0.9, 0.05], [0.1, 0.8, 0.1], [0.25, 0.25, 0.5], [1 / 3] * 3]
    model, prompt, answer = FixedModel(probs), [0, 0], [1, 1, 2]
    m = ceiling()
    # a correct response: P(rest | prefix) at each state
    assert (m.oracle_values(model, prompt, [1, 1, 2], answer)
            == pytest.approx([0.9 * 0.8 * 0.5, 0.8 * 0.5, 0.5]))
    # a slip at the second token: the states after it are worth 0, the ones before it are not
    assert m.oracle_values(model, prompt, [1, 0, 2], answer) == pytest.approx([0.36, 0.4, 0.0])
    # longer than the answer: past the answer's end the value is 0
    assert m.oracle_values(model, prompt, [1, 1, 1, 2], answer) == pytest.approx([0.36, 0.4, 0.5, 0.0])


def test_explained_variance():
    m = ceiling()
    returns = np.array([0.0, 1.0, 1.0, 0.0])
    assert m.explained_variance(returns, returns) == 1.0
    assert m.explained_variance(np.full(4, 0.5), returns) == 0.0
    # residuals [0, 0, 1, 0]: variance 3/16 against 1/4
    assert m.explained_variance(np.array([0.0, 1.0, 0.0, 0.0]), returns) == pytest.approx(0.25)
    assert math.isnan(m.explained_variance(returns, np.ones(4)))
