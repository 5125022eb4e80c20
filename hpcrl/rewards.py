"""Reward functions: the built-ins, the loader for `module:function` names from the config, and
`merge`, the one place where the outputs of reward sources become a weighted reward.

A reward function takes one sample, `fn(response, ground_truth, *, data_source, prompt)`, and
returns a float or a dict with a float `score`, optional float components and an optional
string `message` (a verifier's explanation). Pure functions: no I/O, no global state.

A reward source (a function, the reward model, the HTTP service of hpcrl/reward_backends.py)
scores a batch: it takes a list of samples, dicts with `prompt`, `response`, `ground_truth`
and `data_source`, and returns one output per sample in the same shape as a reward function's.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

Output = float | dict
RewardFn = Callable[..., Output]
Source = Callable[[list[dict]], list[Output]]


def exact_match(response: str, ground_truth: str, **_) -> dict:
    """1 when the response, stripped of surrounding space, equals the ground truth."""
    text = response.strip()
    return {"score": float(text == ground_truth.strip()), "nonempty": float(bool(text))}


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?[0-9][0-9\.\,]*")


def _normalise_number(s: str) -> str:
    s = s.replace(",", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return s
    return str(int(value)) if value == int(value) else str(value)


def gsm8k(response: str, ground_truth: str, **_) -> dict:
    """GSM8K final-answer match: the `#### <answer>` line (strict) or else the last number (flexible).

    The score is 1 for a strict match; the `flexible` component records a last-number match.
    """
    truth = _normalise_number(ground_truth.split("####")[-1].strip())
    strict = _GSM8K_STRICT.findall(response)
    numbers = _NUMBER.findall(response)
    strict_ok = bool(strict) and _normalise_number(strict[-1]) == truth
    flexible_ok = bool(numbers) and _normalise_number(numbers[-1]) == truth
    message = "" if strict else "no '#### <answer>' line"
    return {"score": float(strict_ok), "format": float(bool(strict)), "flexible": float(flexible_ok),
            "message": message}


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer, then falling linearly to
    -factor at max_tokens (Yu et al. 2025)."""
    if buffer <= 0:
        return 0.0
    exceed = length - (max_tokens - buffer)
    return min(-exceed / buffer * factor, 0.0)


@dataclass(frozen=True)
class Scored:
    reward: float
    components: dict[str, float]
    message: str


class RewardLoadError(ValueError):
    pass


def load(name: str) -> RewardFn:
    """Import `module:function`; a clear error names what is missing."""
    module_name, sep, fn_name = name.partition(":")
    if not sep or not module_name or not fn_name:
        raise RewardLoadError(f"reward function {name!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardLoadError(f"reward function {name!r}: cannot import module {module_name!r}: "
                              f"{err}") from None
    except Exception as err:  # noqa: BLE001 - the user's module, whatever it raises
        raise RewardLoadError(f"reward function {name!r}: importing {module_name} raised "
                              f"{type(err).__name__}: {err}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise RewardLoadError(f"reward function {name!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def per_sample(fn: RewardFn) -> Source:
    """A reward function as a reward source: called on each sample of the batch in turn."""
    def source(samples: list[dict]) -> list[Output]:
        return [fn(s["response"], s["ground_truth"], data_source=s["data_source"], prompt=s["prompt"])
                for s in samples]

    return source


class RewardValueError(ValueError):
    """A reward source gave something that is not a finite number where one is required."""


def _finite(name: str, key: str, value) -> float:
    """`value` as a float, refusing what is not a finite number (a string, None, NaN, inf)."""
    try:
        number = float(value) if not isinstance(value, str | bytes) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number):
        raise RewardValueError(f"reward source {name!r} gave {key} = {value!r}; expected a finite number")
    return number


def merge(outputs: dict[str, Output], weights: dict[str, float]) -> Scored:
    """Weighted sum of one sample's outputs by source name, with every component kept under
    `<name>` (its score) and `<name>/<key>` (its other components). Every number must be finite."""
    total, components, messages = 0.0, {}, []
    for name, out in outputs.items():
        if not isinstance(out, dict):
            out = {"score": out}
        if "score" not in out:
            raise RewardValueError(f"reward source {name!r} gave a dict without 'score' (keys {sorted(out)})")
        score = _finite(name, "score", out["score"])
        total += weights[name] * score
        components[name] = score
        for key, value in out.items():
            if key == "message":
                if value:
                    messages.append(f"{name}: {value}")
            elif key != "score":
                components[f"{name}/{key}"] = _finite(name, key, value)
    return Scored(total, components, "; ".join(messages))
