"""Hostile and careless inputs are refused before any job starts, naming the file, the key and
what was expected: non-finite numbers anywhere in the config, sbatch options that could reach a
shell, and the same through `hpcrl submit` (exit code 2, one line, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpcrl import config
from hpcrl.config import ConfigError

NON_FINITE = [
    ("update", "lr", float("inf")),
    ("update", "lr", float("nan")),
    ("update", "weight_decay", float("inf")),
    ("generate", "temperature", float("inf")),
    ("algorithm", "clip_ratio", float("nan")),
    ("algorithm", "kl.coef", float("inf")),
    ("algorithm", "critic.gamma", float("nan")),
]


@pytest.mark.parametrize("section, key, value", NON_FINITE)
def test_a_non_finite_number_is_refused(write_experiment, section, key, value):
    """Pins: update.lr = inf accepted (it trained a non-finite policy)."""
    *parents, leaf = key.split(".")
    values = {leaf: value}
    for parent in reversed(parents):
        values = {parent: values}
    path = write_experiment(**{section: values})
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert (str(path) in str(err.value)
            and f"{section}.{key}: Input should be a finite number" in str(err.value))


def test_a_non_finite_reward_weight_is_refused(write_experiment):
    path = write_experiment(reward={"functions": ["hpcrl.rewards:exact_match"], "weights": [float("nan")]})
    with pytest.raises(ConfigError, match=r"reward\.weights\.0: Input should be a finite number"):
        config.load(path)


SBATCH_EXTRA = [
    # a key that starts a shell line
    ({"exclude\ntouch /tmp/hpcrl-pwned\n#": "n1"}, "is not an sbatch option name"),
    ({"--exclude": "n1"}, "is not an sbatch option name"),
    ({"Exclude": "n1"}, "is not an sbatch option name"),
    ({"": "n1"}, "is not an sbatch option name"),
    ({"exclude": "n1\ntouch /tmp/hpcrl-pwned"}, "has the value"),
    ({"exclude": "n1\n"}, "has the value"),
    ({"exclude": "n1;rm"}, "has the value"),
    ({"comment": "$(id)"}, "has the value"),
]


@pytest.mark.parametrize("extra, says", SBATCH_EXTRA)
def test_sbatch_options_that_could_reach_a_shell_are_refused(write_experiment, extra, says):
    """Pins: keys of executor.<role>.extra unchecked (a newline in a key put a shell line into
    every sbatch script, and submitit writes keys verbatim too)."""
    path = write_experiment(executor={"update": {"extra": extra}})
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert "executor.update.extra" in str(err.value) and says in str(err.value)


def test_plain_sbatch_options_are_accepted(write_experiment):
    exp = config.load(write_experiment(executor={"update": {"extra": {"exclude": "n[1-3]",
                                                                      "gres-flags": "enforce-binding"}}}))
    assert exp.executor.update.extra == {"exclude": "n[1-3]", "gres-flags": "enforce-binding"}


def test_submit_names_a_bad_sbatch_key_in_one_line(write_experiment, tmp_path):
    path = write_experiment(executor={"update": {"extra": {"exclude\ntouch x": "n1"}}})
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", "--dry-run", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert str(path) in out.stderr and "executor.update.extra" in out.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was created


BAD_REWARDS = [
    (float("nan"), "gave score = nan; expected a finite number"),
    (float("inf"), "gave score = inf; expected a finite number"),
    ("1.0", "gave score = '1.0'; expected a finite number"),
    (None, "gave score = None; expected a finite number"),
    ({"score": 1.0, "format": float("-inf")}, "gave format = -inf; expected a finite number"),
    ({"format": 1.0}, "gave a dict without 'score' (keys ['format'])"),
]


@pytest.mark.parametrize("output, says", BAD_REWARDS)
def test_a_reward_that_is_not_a_finite_number_is_refused_naming_the_function_and_sample(output, says):
    """Pins: NaN and inf rewards committed to scores.parquet (only the HTTP backend checked)."""
    from hpcrl import scoring
    from tests.synthetic_run import rollouts_table

    rollouts = rollouts_table(0, n_train=8, n_val=0, group_size=4)

    def source(batch):
        return [1.0] * 5 + [output] + [0.0] * (len(batch) - 6)

    row = rollouts.slice(5, 1).to_pylist()[0]
    with pytest.raises(ValueError) as err:
        scoring.score(rollouts, {"my_rewards:judge": source}, {"my_rewards:judge": 1.0})
    assert str(err.value) == (f"reward source 'my_rewards:judge' {says}, for train prompt "
                              f"{row['prompt_index']} sample {row['sample_index']}; nothing is committed")
