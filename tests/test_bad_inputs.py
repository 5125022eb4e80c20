"""Hostile and careless inputs are refused before any job starts, naming the file, the key and
what was expected: non-finite numbers anywhere in the config, sbatch options that could reach a
shell, rewards that are not finite numbers, and bad config values, models, data, reward sources,
run directories and files through `hpcrl submit` (exit code 2, one line, no traceback)."""

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


# Through `hpcrl submit --dry-run` (in-process): each refused with exit code 2, the file, the key
# and what was expected, in one error line, without a traceback, and nothing created.
BAD_CONFIGS = [  # (sections written over the test experiment, what the error says)
    ({"run": {"iterations": 0}}, "run.iterations: Input should be greater than or equal to 1"),
    ({"run": {"name": "../elsewhere"}}, "run.name: Value error, a run name is a plain directory name"),
    ({"run": {"name": "r" * 201}}, "run.name: Value error, a run name is at most 200 bytes"),
    ({"run": {"dir_mode": "0999"}}, "run.dir_mode: String should match pattern"),
    ({"algorithm": {"name": "ppoo"}}, "algorithm.name: 'ppoo' is not a registered advantage estimator"),
    ({"algorithm": {"policy_loss": "sapo"}}, "algorithm.policy_loss: 'sapo' is not a registered policy loss"),
    ({"algorithm": {"group_size": 1}}, "algorithm.group_size: grpo compares samples of one prompt"),
    ({"algorithm": {"dual_clip_c": 0.5}}, "algorithm.dual_clip_c: expected 0 (off) or a value above 1"),
    ({"algorithm": {"kl": {"target": 1.0}}}, "algorithm.kl.target: the adaptive KL controller starts from"),
    ({"algorithm": {"critic": {"lr": 1e-3}}}, "algorithm.critic: only algorithm.name = \"ppo\" has a critic"),
    ({"algorithm": {"kl_coef": 0.1}}, "algorithm.kl_coef: this key is now algorithm.kl.coef"),
    ({"algorithm": {"loss_agg": "sum"}}, "algorithm.loss_agg: Input should be 'token-mean'"),
    ({"algorithm": {"kl": {"estimator": "k4"}}},
     "algorithm.kl.estimator: Input should be 'k1', 'k2' or 'k3'"),
    ({"generate": {"top_p": 1.5}}, "generate.top_p: Input should be less than or equal to 1"),
    ({"generate": {"max_tokens": 0}}, "generate.max_tokens: Input should be greater than or equal to 1"),
    ({"update": {"zero_stage": 4}}, "update.zero_stage: Input should be 0, 1, 2 or 3"),
    ({"update": {"mini_batches": 3}}, "do not split evenly into 3 mini-batches"),
    ({"reward": {"functions": ["no_such_module:fn"]}}, "reward.functions"),
    ({"reward": {"functions": []}}, "reward: no reward source: expected reward.functions"),
    ({"reward": {"weights": [1.0, 2.0]}},
     "reward.weights: expected 1 weights (one per reward.functions entry)"),
    ({"reward": {"http": {"url": "ftp://rm/score"}}}, "reward.http.url: Value error, expected an http://"),
    ({"reward": {"overlong_buffer": 100}},
     "reward.overlong_buffer: expected at most generate.max_tokens = 8"),
    ({"executor": {"kind": "k8s"}}, "executor.kind: Input should be 'local' or 'slurm'"),
    ({"executor": {"resident": {"stall_s": 5}}}, "executor.resident: only with executor.mode = \"resident\""),
    ({"executor": {"mode": "resident", "resident": {"weight_sync": "shm"}}},
     "executor.resident.weight_sync: Input should be 'auto', 'process_group', 'shared_memory' or "
     "'filesystem'"),
    ({"executor": {"mode": "batch"}}, "executor: Input tag 'batch' found using"),
    ({"alerts": {"stop": ["everything"]}}, "alerts.stop.0: Input should be 'non_finite'"),
    ({"alerts": {"clip_ratio_max": 2.0}}, "alerts.clip_ratio_max: Input should be less than or equal to 1"),
    ({"alerts": {"webhook": "hooks.example.org/T0"}},
     "alerts.webhook: Value error, expected an http:// or https:// URL with a host"),
    ({"executor": {"notify": {"webhook": "https://hooks.example.org:99999/x"}}},
     "executor.notify.webhook: Value error, expected an http:// or https:// URL with a valid port"),
    ({"tracking": {"plot_every": -1}}, "tracking.plot_every: Input should be greater than or equal to 0"),
    ({"model": {"path": "/no/such/model"}}, "model.path: /no/such/model: not an HF model directory"),
    ({"model": {"dtype": "int8"}}, "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ({"model": {"max_model_len": 4}}, "model.max_model_len: Input should be greater than or equal to 8"),
    ({"model": {"pth": "x"}}, "model.pth: unknown key in [model]"),
    ({"algorithms": {"name": "grpo"}}, "algorithms: unknown key in the top level"),
    ({"data": {"train": "/no/such/train.parquet"}}, "data.train: /no/such/train.parquet"),
    ({"data": {"prompt_key": "question"}}, "data.train"),
]


def _dry_run(path):
    from click.testing import CliRunner

    from hpcrl.cli import main

    return CliRunner().invoke(main, ["submit", "--dry-run", str(path)])


@pytest.mark.parametrize("sections, says", BAD_CONFIGS, ids=[s for _, s in BAD_CONFIGS])
def test_a_bad_config_is_refused_by_submit_in_one_line(write_experiment, tmp_path, sections, says):
    path = write_experiment("bad", **sections)
    result = _dry_run(path)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
    assert str(path) in result.stderr and says in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs" / "bad").exists()  # refused before a run was created


BAD_FILES = [  # (what the config file holds, what the error says)
    (b"[run\nname = 1", "not valid TOML"),
    (b"\xff\xfe[run]\n", "not valid UTF-8"),
    (b"[run]\nname = \"r\"\n", "model: required key is missing"),
]


@pytest.mark.parametrize("content, says", BAD_FILES, ids=[s for _, s in BAD_FILES])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, content, says):
    path = tmp_path / "e.toml"
    path.write_bytes(content)
    result = _dry_run(path)
    assert result.exit_code == 2 and str(path) in result.stderr and says in result.stderr, result.output
    missing = _dry_run(tmp_path / "missing.toml")
    assert missing.exit_code == 2 and "missing.toml: config file not found" in missing.stderr


def test_a_runs_root_that_is_a_file_is_named(write_experiment, tmp_path):
    (tmp_path / "afile").write_text("")
    path = write_experiment("r", run={"runs_root": str(tmp_path / "afile")})
    from click.testing import CliRunner

    from hpcrl.cli import main

    result = CliRunner().invoke(main, ["submit", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"run.runs_root: {tmp_path / 'afile'}: {tmp_path / 'afile'} is not a directory" in result.stderr
