"""Bad input is refused before any stage runs, with the file, the key and what was expected."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl import config, config_training, preflight, runs
from hpcrl.config import ConfigError


def _load_checked(path):
    exp = config.load(path)
    preflight.check(exp, str(path))
    return exp


def test_unknown_key_names_file_section_and_key(tmp_path, write_experiment):
    path = write_experiment(update={"learning_rate": 1e-3})
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert str(path) in str(err.value)
    assert "update.learning_rate: unknown key in [update]" in str(err.value)


def test_wrong_type_names_key_and_expectation(write_experiment):
    path = write_experiment(algorithm={"group_size": "eight"})
    with pytest.raises(ConfigError, match=r"algorithm\.group_size: Input should be a valid integer.*'eight'"):
        config.load(path)


def test_missing_required_key(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('[run]\nname = "x"\n[data]\ntrain = "a.parquet"\n')
    with pytest.raises(ConfigError, match=r"model: required key is missing"):
        config.load(path)


def test_invalid_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(tmp_path / "nope.toml")


def test_missing_data_file(write_experiment, tmp_path):
    path = write_experiment(data={"train": str(tmp_path / "absent.parquet")})
    with pytest.raises(ConfigError, match=r"data\.train: .*absent\.parquet: dataset file not found"):
        _load_checked(path)


def test_dataset_without_prompt_column(write_experiment, tmp_path):
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), tmp_path / "noprompt.parquet")
    path = write_experiment(data={"train": str(tmp_path / "noprompt.parquet")})
    with pytest.raises(ConfigError, match=r"data\.train: .*noprompt\.parquet: no prompt column 'prompt'"):
        _load_checked(path)


def test_plain_columns_and_jsonl_are_accepted(write_experiment, tmp_path):
    pq.write_table(pa.table({"prompt": [f"{i}+1=" for i in range(8)],
                             "answer": [str(i + 1) for i in range(8)]}),
                   tmp_path / "plain.parquet")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    exp = _load_checked(write_experiment(data={"train": str(tmp_path / "plain.parquet"),
                                               "test": str(tmp_path / "p.jsonl")}))
    assert exp.data.train.endswith("plain.parquet")


def test_tokenizer_that_does_not_match_the_model(write_experiment, tiny_task, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    cfg = json.loads((tiny_task / "model" / "config.json").read_text())
    cfg["vocab_size"] = 16
    (model / "config.json").write_text(json.dumps(cfg))
    path = write_experiment(model={"path": str(model), "tokenizer": str(tiny_task / "model")})
    with pytest.raises(ConfigError, match=r"model\.tokenizer: the tokenizer .* has \d+ tokens but the "
                                          r"model .* has vocab_size 16"):
        _load_checked(path)


def test_model_directory_without_config(write_experiment, tmp_path):
    path = write_experiment(model={"path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"model\.path: .*not an HF model directory"):
        _load_checked(path)


def test_unknown_reward_function(write_experiment):
    path = write_experiment(reward={"functions": ["hpcrl.rewards:nope"]})
    with pytest.raises(ConfigError, match=r"reward\.functions: .*has no function 'nope'"):
        _load_checked(path)


def test_dataset_smaller_than_one_iteration(write_experiment, tmp_path):
    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), tmp_path / "one.parquet")
    path = write_experiment(data={"train": str(tmp_path / "one.parquet")})
    with pytest.raises(ConfigError, match=r"data\.train: .*1 prompts, fewer than "
                                          r"algorithm\.prompts_per_iteration = 8"):
        _load_checked(path)


def test_batch_that_does_not_split_over_ranks(write_experiment):
    path = write_experiment(update={"mini_batches": 3})
    with pytest.raises(ConfigError, match=r"update\.mini_batches: 32 samples .* do not split evenly"):
        _load_checked(path)


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "e.toml"
    path.write_text('[model]\npath = "m"\n[data]\ntrain = "../d.parquet"\n')
    exp = config.load(path)
    assert exp.model.path == str(tmp_path / "sub" / "m")
    assert exp.data.train == str(tmp_path / "d.parquet")


def test_resume_refuses_changed_config_but_allows_more_iterations(write_experiment, tmp_path):
    exp = config.load(write_experiment())
    run, resumed = runs.prepare(exp, "e.toml")
    assert not resumed and run.config_path.is_file()
    frozen = config.load(run.config_path)
    assert frozen == exp
    with pytest.raises(ConfigError, match=r"update\.lr: run has 0\.0002, config has 0\.1"):
        runs.prepare(config.with_overrides(exp, {"update.lr": 0.1}, "e.toml"), "e.toml")
    final_val = run.iteration_dir(2) / "generate"
    final_val.mkdir(parents=True)  # stands for the final validation of the 2-iteration run
    longer = config.with_overrides(exp, {"run.iterations": 5}, "e.toml")
    run2, resumed = runs.prepare(longer, "e.toml")
    assert resumed and config.load(run2.config_path).run.iterations == 5
    assert run2.read_run_info()["config_changes"][0]["keys"] == {"run.iterations": 5}
    assert not run.iteration_dir(2).exists()  # iteration 2 now trains; its old validation is kept aside
    assert (run.root / "iter_000002.final-validation" / "generate").is_dir()
    with pytest.raises(ConfigError, match=r"run\.iterations: the run has 5; it may grow on resume, "
                                          r"not shrink"):
        runs.prepare(config.with_overrides(exp, {"run.iterations": 3}, "e.toml"), "e.toml")


def test_ppo_only_keys_and_kl_controller_need_their_algorithm(write_experiment):
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.mode: only algorithm\.name = \"ppo\""):
        config.load(write_experiment(algorithm={"kl": {"mode": "reward", "coef": 0.1}}))
    with pytest.raises(ConfigError, match=r"algorithm\.critic: only algorithm\.name = \"ppo\" has a critic"):
        config.load(write_experiment(algorithm={"critic": {"warmup": 2}}))
    with pytest.raises(ConfigError, match=r"algorithm\.group_size: grpo compares samples of one prompt"):
        config.load(write_experiment(algorithm={"group_size": 1, "prompts_per_iteration": 16}))
    with pytest.raises(ConfigError, match=r"algorithm\.kl\.target: .*set coef > 0"):
        config.load(write_experiment(algorithm={"name": "ppo", "kl": {"target": 1.0}}))
    exp = config.load(write_experiment(algorithm={"name": "ppo", "group_size": 1, "prompts_per_iteration": 16,
                                                  "kl": {"mode": "reward", "coef": 0.05, "target": 1.0}}))
    assert exp.algorithm.kl.mode == "reward" and exp.algorithm.critic == config_training.CriticConfig()
    assert config.load(write_experiment()).algorithm.critic is None  # grpo has none


def test_a_key_that_moved_into_a_section_names_its_new_place(write_experiment):
    path = write_experiment("old", algorithm={"name": "ppo", "kl_coef": 0.1, "critic_lr": 1e-3, "gamma": 0.9},
                            executor={"mode": "resident", "weight_sync": "shared_memory"})
    with pytest.raises(ConfigError) as err:
        config.load(path)
    for old, new in [("algorithm.kl_coef", "algorithm.kl.coef"),
                     ("algorithm.critic_lr", "algorithm.critic.lr"),
                     ("algorithm.gamma", "algorithm.critic.gamma"),
                     ("executor.weight_sync", "executor.resident.weight_sync")]:
        assert f"{old}: this key is now {new}" in str(err.value)
    with pytest.raises(ConfigError, match=r"executor\.resident: only with executor\.mode = \"resident\""):
        config.load(write_experiment("staged", executor={"resident": {"stall_s": 5}}))
    from tools.migrate_config import migrate

    path.with_name("m.toml").write_text(migrate(path.read_text()))  # tools/migrate_config.py rewrites it
    moved = config.load(path.with_name("m.toml"))
    assert (moved.algorithm.kl.coef, moved.algorithm.critic.lr, moved.executor.resident.weight_sync) == (
        0.1, 1e-3, "shared_memory")


def test_an_older_frozen_config_migrates_to_one_that_loads(write_experiment):
    """A frozen config of an older version lists every key: the critic's for grpo, the resident
    job's for a staged run. The migration leaves out what the new schema refuses, and says so."""
    import tomllib

    import tomli_w

    from tools.migrate_config import migrate

    data = tomllib.loads(write_experiment("frozen").read_text())
    data["algorithm"].update(kl_coef=0.05, kl_estimator="k1", gamma=1.0, lam=0.95, critic_lr=1e-5)
    data["executor"] = {"mode": "staged", "weight_sync": "auto", "stall_s": 20,
                        "resident": {"partition": "", "time_min": 1440, "extra": {"exclude": "n3"}},
                        "update": {"time_min": 30}}
    dropped: list[str] = []
    new = migrate(tomli_w.dumps(data), dropped)
    path = write_experiment("migrated")
    path.write_text(new)
    exp = config.load(path)
    assert (exp.algorithm.kl.coef, exp.algorithm.kl.estimator, exp.algorithm.critic) == (0.05, "k1", None)
    assert exp.executor.mode == "staged" and exp.executor.update.time_min == 30
    assert sorted(dropped) == ["algorithm.critic_lr", "algorithm.gamma", "algorithm.lam",
                               "executor.resident.extra.exclude", "executor.resident.partition",
                               "executor.resident.time_min", "executor.stall_s", "executor.weight_sync"]
    data["executor"]["mode"] = "resident"  # the same older file of a resident run keeps its resident section
    resident = config.parse(tomllib.loads(migrate(tomli_w.dumps(data))), "old", path.parent)
    assert (resident.executor.resident.time_min, resident.executor.resident.stall_s) == (1440, 20)
    assert resident.executor.resident.extra == {"exclude": "n3"}


def test_a_critic_path_without_a_model_is_refused(write_experiment, tmp_path):
    path = write_experiment(algorithm={"name": "ppo", "critic": {"path": str(tmp_path / "no-critic")}})
    with pytest.raises(ConfigError, match=r"algorithm\.critic\.path: .*no-critic: not an HF model directory"):
        _load_checked(path)


def test_a_load_balancing_loss_needs_a_mixture_of_experts(write_experiment):
    path = write_experiment(update={"moe_aux_loss_coef": 0.01})
    with pytest.raises(ConfigError, match=r"update\.moe_aux_loss_coef: 0\.01 asks for a load-balancing loss, "
                                          r"but .* is not a mixture-of-experts model"):
        _load_checked(path)


def test_lora_targets_must_name_linear_layers_of_the_model(write_experiment):
    """pins: an adapter target that matches nothing found only when the update job starts, or one
    on the embedding (whose adapters the merge and the tied head would not carry)."""
    path = write_experiment(update={"lora": {"rank": 4, "target_modules": ["q_proj", "qkv", "embed_tokens"]}})
    with pytest.raises(ConfigError, match=r"update\.lora\.target_modules: \['qkv', 'embed_tokens'\] name no "
                                          r"linear layer of "
                                          r".*; expected some of \[.*'down_proj', .*'q_proj'"):
        _load_checked(path)
    _load_checked(write_experiment("ok", update={"lora": {"rank": 4, "target_modules": ["q_proj", "up_proj"]}
                                                 }))
    _load_checked(write_experiment("off", update={"lora": {"rank": 0, "target_modules": ["qkv"]}}))


def test_shared_memory_weights_need_one_node(write_experiment):
    def resident(nodes: int) -> dict:
        return {"kind": "slurm", "mode": "resident",
                "resident": {"nodes": nodes, "weight_sync": "shared_memory"}}

    with pytest.raises(ConfigError, match=r"executor\.resident\.weight_sync: \"shared_memory\" needs "
                                          r"trainer 0 and the generator on one node, but nodes = 2"):
        config.load(write_experiment(update={"world_size": 1}, executor=resident(2)))
    exp = config.load(write_experiment(executor=resident(1)))
    assert exp.executor.resident.weight_sync == "shared_memory"


def test_colocation_is_refused_with_asynchronous_generation(write_experiment):
    """pins: a resident run that samples while the trainers update on the GPUs vLLM would give them."""
    path = write_experiment("coloc", algorithm={"max_staleness": 1},
                            executor={"mode": "resident", "resident": {"colocate": True}})
    with pytest.raises(ConfigError, match=r"executor\.resident\.colocate: asynchronous generation"):
        config.load(path)
    config.load(write_experiment("sync", update={"offload": "optimizer"},
                                 executor={"mode": "resident", "resident": {"colocate": True}}))


_MINIMAL = {"model": {"path": "/m"}, "data": {"train": "/t.parquet"}}


def _error(data: dict, source: str = "e.toml") -> str:
    with pytest.raises(ConfigError) as err:
        config.parse(data, source, Path("/"))
    return str(err.value)


def test_every_error_of_a_file_is_listed_at_its_key_and_section():
    """pins: one line per error under "<file>: invalid config:", two spaces in; an unknown key names
    its whole section ([algorithm.kl], not [algorithm]), or "the top level"; a key named like an
    executor mode outside [executor] keeps its place; a section rule without a key of its own is
    reported at the section."""
    data = {**_MINIMAL, "nope": 1, "update": {"resident": True}, "algorithm": {"kl": {"nope": 2}}}
    assert _error(data) == ("e.toml: invalid config:\n"
                            "  algorithm.kl.nope: unknown key in [algorithm.kl]\n"
                            "  update.resident: unknown key in [update]\n"
                            "  nope: unknown key in the top level")
    assert _error({**_MINIMAL, "reward": {"functions": []}}) == (
        "e.toml: invalid config:\n  reward: no reward source: expected reward.functions, "
        "reward.model.path or reward.http.url")


def test_the_executor_is_told_apart_by_its_mode():
    """pins: [executor] as a table is read as the variant its `mode` names (staged when left out); an
    executor model is taken as the variant it is; anything else is refused as not a table."""
    from hpcrl.config_jobs import ResidentConfig, ResidentExecutor, StagedExecutor

    resident = config.Experiment.model_validate(
        {**_MINIMAL, "executor": ResidentExecutor(resident=ResidentConfig(stall_s=5))})
    assert isinstance(resident.executor, ResidentExecutor) and resident.executor.resident.stall_s == 5
    staged = config.Experiment.model_validate({**_MINIMAL, "executor": StagedExecutor(max_retries=4)})
    assert isinstance(staged.executor, StagedExecutor) and staged.executor.max_retries == 4
    assert type(config.parse({**_MINIMAL, "executor": {}}, "e", Path("/")).executor) is StagedExecutor
    assert _error({**_MINIMAL, "executor": "resident"}) == (
        "e.toml: invalid config:\n  executor: Input should be a valid dictionary or instance of "
        "StagedExecutor (got 'resident')")


def test_executor_mode_has_the_documented_default_and_meaning():
    """pins: the `executor.mode` field of each variant (made by config_jobs._mode when the module is
    imported, so called here again): its default is the variant's mode, and its description is the
    one docs/configuration.md gives for executor.mode."""
    from hpcrl.config_jobs import ResidentExecutor, StagedExecutor, _mode

    row = next(line for line in (Path(__file__).parents[1] / "docs" / "configuration.md")
               .read_text().splitlines() if line.startswith("| `executor.mode` |"))
    for mode in ("staged", "resident"):
        field = _mode(mode)
        assert field.default == mode and not field.is_required()
        assert f"| `executor.mode` | `\"staged\"` | {field.description} One of " in row
    assert (StagedExecutor().mode, ResidentExecutor().mode) == ("staged", "resident")


def test_the_keys_resolved_against_the_config_file_are_the_path_keys():
    """pins: which keys hold paths (config._path_fields, run at import for PATH_KEYS): every PathStr
    key, nested sections included, each once, with its dotted prefix."""
    from hpcrl.config_training import AlgorithmConfig

    keys = ["run.runs_root", "model.path", "model.tokenizer", "data.train", "data.test",
            "algorithm.critic.path", "reward.model.path"]
    assert config._path_fields(config.Experiment) == keys
    assert config.PATH_KEYS == keys
    assert config._path_fields(AlgorithmConfig, "a.") == ["a.critic.path"]
    assert config._path_fields(AlgorithmConfig) == ["critic.path"]


def test_a_config_file_that_is_not_utf8_is_refused_with_the_byte(tmp_path):
    """pins: a file that is not UTF-8 is refused naming the file and the offset of the first bad byte."""
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert str(err.value) == f"{path}: not valid UTF-8 (byte 17): a config file is UTF-8 TOML"


def test_a_config_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    """pins: config.load reads UTF-8 even where the locale's encoding is ASCII (LC_ALL=C without
    Python's UTF-8 mode, as on some clusters). Runs the loader in a subprocess with that locale,
    after loading the file here (so that mutation testing knows this test reaches config.load)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "e.toml"
    path.write_text('[model]\npath = "m"\n[data]\ntrain = "t.parquet"\nprompt_key = "Frage_ü"\n',
                    encoding="utf-8")
    assert config.load(path).data.prompt_key == "Frage_ü"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    out = subprocess.run([sys.executable, "-c", "import sys; from hpcrl import config; "
                          "print(ascii(config.load(sys.argv[1]).data.prompt_key))", str(path)],
                         env=env, cwd=Path(config.__file__).parents[1], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ascii("Frage_ü")


def test_set_assignments_are_toml_values_or_bare_strings():
    """pins: `--set KEY=VALUE`: the key stripped, the value a TOML value (number, string, list, bool) or
    else the raw text; no `=` or an empty key is refused naming the option and the item."""
    assert config.parse_assignments([" update.lr =1e-5", "run.name=try-2", 'run.name="x = y"', "a.b=[1, 2]",
                                     "c=true", "d="]) == {
        "update.lr": 1e-5, "run.name": "x = y", "a.b": [1, 2], "c": True, "d": ""}
    assert config.parse_assignments(["run.name=try-2"]) == {"run.name": "try-2"}
    assert config.parse_assignments([]) == {}
    for bad in ("update.lr", " =3"):
        with pytest.raises(ConfigError) as err:
            config.parse_assignments(["run.name=a", bad], "--override")
        assert str(err.value) == (f"--override {bad!r}: expected KEY=VALUE, e.g. update.lr=1e-5 or "
                                  "run.name=\"try-2\"")
    with pytest.raises(ConfigError, match=r"^--set 'x': expected KEY=VALUE"):
        config.parse_assignments(["x"])


def test_overrides_fill_optional_sections_and_refuse_unknown_ones(monkeypatch, tmp_path):
    """pins: an override may set a key of an optional section the config leaves out
    ([algorithm.critic]); a key under a section that does not exist is refused naming the source;
    errors of the result name the source; relative paths given by an override resolve against the
    working directory."""
    exp = config.parse(_MINIMAL, "e.toml", Path("/"))
    ppo = config.with_overrides(exp, {"algorithm.name": "ppo", "algorithm.critic.lr": 1e-3}, "--set")
    assert ppo.algorithm.critic.lr == 1e-3 and ppo.algorithm.critic.gamma == 1.0
    with pytest.raises(ConfigError) as err:
        config.with_overrides(exp, {"algorithm.nope.x": 1}, "e.toml with --set")
    assert str(err.value) == "e.toml with --set: algorithm.nope.x: unknown key"
    with pytest.raises(ConfigError) as err:
        config.with_overrides(exp, {"update.lr": -1.0}, "e.toml with --set")
    assert str(err.value).startswith("e.toml with --set: invalid config:\n  update.lr: ")
    monkeypatch.chdir(tmp_path)
    moved = config.with_overrides(exp, {"data.test": "sub/t.parquet"}, "--set")
    assert moved.data.test == str(tmp_path / "sub" / "t.parquet") and moved.data.train == "/t.parquet"


def test_an_override_to_staged_drops_the_resident_section():
    """pins: overriding executor.mode to "staged" on a resident config drops [executor.resident]
    (a resident run continued staged), unless the overrides set an executor.resident key too, which
    is refused; other overrides of a resident config keep its [executor.resident]."""
    from hpcrl.config_jobs import StagedExecutor

    resident = config.parse({**_MINIMAL, "executor": {"mode": "resident", "resident": {"stall_s": 5}}}, "e",
                            Path("/"))
    staged = config.with_overrides(resident, {"executor.mode": "staged"}, "--set")
    assert type(staged.executor) is StagedExecutor and "executor.resident.stall_s" not in config.flat(staged)
    still = config.with_overrides(resident, {"update.lr": 0.5}, "--set")
    assert still.executor.mode == "resident" and still.executor.resident.stall_s == 5
    with pytest.raises(ConfigError, match=r"executor\.resident: only with executor\.mode = \"resident\""):
        config.with_overrides(resident, {"executor.mode": "staged", "executor.resident.stall_s": 9}, "--set")


def test_flat_keys_leave_sbatch_options_whole_and_absent_sections_out():
    """pins: config.flat (MLflow params, resume diffs): dotted keys, an `extra` table of sbatch options
    kept as one value, and no keys for sections the config leaves out (no None values)."""
    exp = config.parse({**_MINIMAL, "executor": {"update": {"extra": {"exclude": "n3"}}}}, "e",
                       Path("/"))
    flat = config.flat(exp)
    assert flat["executor.update.extra"] == {"exclude": "n3"} and flat["update.lr"] == 1e-5
    assert "executor.update.extra.exclude" not in flat
    assert None not in flat.values() and not any(k.startswith("algorithm.critic") for k in flat)


def test_resume_conflicts_list_keys_on_either_side_only():
    """pins: a resumed run's refused changes include keys that only one side has (a section that
    came or went), each as "key: run has X, config has Y", sorted."""
    exp = config.parse(_MINIMAL, "e", Path("/"))
    ppo = config.with_overrides(exp, {"algorithm.name": "ppo"}, "--set")
    conflicts = config.resume_conflicts(exp, ppo)
    assert conflicts[0] == "algorithm.critic.gamma: run has None, config has 1.0"
    assert conflicts[-1] == "algorithm.name: run has 'grpo', config has 'ppo'" and len(conflicts) == 7
    assert config.resume_conflicts(ppo, exp)[0] == "algorithm.critic.gamma: run has 1.0, config has None"


def test_offloading_the_parameters_needs_zero_3(write_experiment):
    """pins: update.offload = "all" accepted where no ZeRO stage partitions the parameters."""
    with pytest.raises(ConfigError, match=r'update\.offload.*"all" offloads the parameters.*got 2'):
        config.load(write_experiment("offload", update={"offload": "all"}))
    exp = config.load(write_experiment("offload3", update={"offload": "all", "zero_stage": 3}))
    assert exp.update.offload == "all"
    from hpcrl import trainer

    exp = config.load(write_experiment("offload1", update={"offload": "optimizer", "zero_stage": 0}))
    assert trainer.zero_stage(exp, 1) == 2  # the stage whose optimizer steps on the CPU, even on one rank
    zero = trainer.ds_config(exp, 1, 1)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero


FIX_STATE = (r"cannot move off the GPU; expected update\.offload = \"optimizer\", or zero_stage = 2 on 2 "
             r"ranks or more$")


@pytest.mark.parametrize(("update", "model", "message"), [
    ({"zero_stage": 2}, {},
     r"the update \(zero_stage = 2 on 1 rank\(s\) in float32\) runs a plain optimizer, whose state DeepSpeed "
     + FIX_STATE),
    ({"zero_stage": 2}, {"dtype": "bfloat16"},
     r"the update \(zero_stage = 2 on 1 rank\(s\) in bfloat16\) runs its bf16 \(ZeRO-1\) optimizer, whose "
     r"state DeepSpeed " + FIX_STATE),
    ({"zero_stage": 1, "world_size": 2}, {"dtype": "bfloat16"}, r"the update \(zero_stage = 1 on 2 rank\(s\) "
     r"in bfloat16\) runs its bf16 \(ZeRO-1\) optimizer"),
    ({"zero_stage": 3, "world_size": 2}, {},
     r"under ZeRO-3 DeepSpeed moves only its FusedAdam's state off the GPU, and the update steps torch's "
     r"AdamW; expected update\.offload = \"optimizer\" or \"all\", or zero_stage = 2$"),
], ids=["stage-0", "bf16-one-rank", "bf16-zero1", "zero3-adamw"])
def test_colocation_whose_trainer_state_cannot_leave_the_gpu_is_refused(write_experiment, update, model,
                                                                        message):
    """pins: a colocated job whose update holds its state on the GPU while vLLM wakes (or fails
    to move it: DeepSpeed's bf16 optimizer has no offload_states)."""
    colocated = {"mode": "resident", "resident": {"colocate": True}}
    with pytest.raises(ConfigError, match=r"executor\.resident\.colocate: " + message):
        config.load(write_experiment(update=update, model=model, executor=colocated))
    for fix in ({"offload": "optimizer"}, {"zero_stage": 2, "world_size": 2}):
        config.load(write_experiment(update={**update, **fix}, model=model, executor=colocated))


def test_the_zero_stage_deepspeed_runs():
    """update.zero_stage as DeepSpeed runs it (hpcrl.config_training.deepspeed_stage), by hand:
    offload runs ZeRO-2 (or 3); bf16 at least ZeRO-1 (its fp32 master weights), and ZeRO-1 for
    ZeRO-2 on one rank; float32 ZeRO-1/2 on one rank as 0. pins: any cell of the table."""
    from hpcrl.config_training import UpdateConfig, deepspeed_stage

    def stage(zero: int, ranks: int, dtype: str, offload: str = "none") -> int:
        return deepspeed_stage(UpdateConfig(zero_stage=zero, world_size=ranks, offload=offload), dtype, ranks)

    fp32 = [[stage(z, n, "float32") for z in range(4)] for n in (1, 2)]
    bf16 = [[stage(z, n, "bfloat16") for z in range(4)] for n in (1, 2)]
    assert fp32 == [[0, 0, 0, 3], [0, 1, 2, 3]]
    assert bf16 == [[1, 1, 1, 3], [1, 1, 2, 3]]
    assert [stage(z, 1, "float32", "optimizer") for z in range(4)] == [2, 2, 2, 3]
    assert [stage(z, 2, "bfloat16", "optimizer") for z in range(4)] == [2, 2, 2, 3]
    assert stage(3, 1, "float32", "all") == 3


DEEPSPEED_ONLY = "train on the DeepSpeed backend only; expected 0"


MEGATRON_REFUSALS = [
    ({"update": {"world_size": 3, "megatron": {"tensor_parallel": 2}}}, "update.world_size",
     "3 ranks do not split into replicas of update.megatron.tensor_parallel x pipeline_parallel = 2 ranks"),
    ({"model": {"dtype": "float16"}}, "model.dtype", "\"float16\" needs loss scaling, which the Megatron "
     "backend does not run; expected \"bfloat16\" or \"float32\""),
    ({"update": {"world_size": 2, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 12}},
     "update.micro_batch_size", "the pipeline's micro-batches must all have one size; expected a divisor of "
     "each replica's 32 rows and of its 16 rows per optimizer step (got 12)"),
    ({"update": {"world_size": 4, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 6}},
     "update.micro_batch_size", "the pipeline's micro-batches must all have one size; expected a divisor of "
     "each replica's 16 rows and of its 8 rows per optimizer step (got 6)"),  # 2 replicas of 16 rows
    ({"algorithm": {"name": "ppo"}}, "algorithm.name", "\"ppo\" needs a critic, which the Megatron backend "
     "does not train yet; expected a critic-free algorithm (grpo, rloo, ...)"),
    ({"algorithm": {"kl": {"coef": 0.1}}}, "algorithm.kl.coef", "a reference model is not kept by the "
     "Megatron backend yet; expected 0"),
    ({"update": {"lora": {"rank": 1}}}, "update.lora.rank", "LoRA adapters " + DEEPSPEED_ONLY),
    ({"update": {"world_size": 2, "sequence_parallel": 2, "share_prompts": False}},
     "update.sequence_parallel", "Ulysses sequence parallelism is the DeepSpeed backend's; expected 1"),
    ({"update": {"max_tokens_per_micro_batch": 1, "share_prompts": False}},
     "update.max_tokens_per_micro_batch", "packed micro-batches are the DeepSpeed backend's; expected 0"),
    ({"update": {"gradient_checkpointing": True, "share_prompts": False}}, "update.gradient_checkpointing",
     "not on the Megatron backend yet; expected false"),
    ({"update": {"offload": "optimizer"}}, "update.offload", "DeepSpeed's offload; expected \"none\" (or "
     "update.megatron.distributed_optimizer for the optimizer state)"),
    ({"update": {"moe_aux_loss_coef": 1e-4}}, "update.moe_aux_loss_coef",
     "mixture-of-experts models " + DEEPSPEED_ONLY),
    ({"executor": {"mode": "resident", "resident": {"colocate": True}}}, "executor.resident.colocate",
     "moving a Megatron trainer's state off the GPU for vLLM is not built yet; expected false"),
]


@pytest.mark.parametrize(("sections", "key", "message"), MEGATRON_REFUSALS)
def test_the_megatron_backend_refuses_what_it_does_not_run(write_experiment, sections, key, message):
    """pins (hpcrl.config_megatron): a feature of the DeepSpeed backend silently ignored by the
    Megatron one (a KL without its reference, a critic never trained, adapters trained whole); each
    at its smallest value that asks for it (LoRA rank 1, a 1-token packing budget)."""
    update = {"backend": "megatron", **sections.get("update", {})}
    path = write_experiment(**{**sections, "update": update})
    with pytest.raises(ConfigError, match=re.escape(f"\n  {key}: update.backend = \"megatron\": {message}")
                       + "$"):
        config.load(path)
    assert config.load(write_experiment(update={"backend": "megatron"})).update.megatron.model_parallel == 1


def test_the_megatron_page_lists_the_keys_the_backend_refuses():
    """docs/megatron.md's table of what the backend does not run names every feature key refused
    above, and no other (the shape rules, world_size and micro_batch_size, are its text's)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "megatron.md").read_text()
    table = page.split("## What it does not run yet", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    listed = {re.split(r" [=>]", name)[0] for cell in cells for name in re.findall(r"`([^`]+)`", cell)}
    refused = {key for _, key, _ in MEGATRON_REFUSALS} - {"update.world_size", "update.micro_batch_size"}
    assert listed == refused


@pytest.mark.parametrize("update", [
    {"micro_batch_size": 12},  # one pipeline stage: a last, smaller micro-batch is fine
    {"world_size": 2, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 8},
    {"world_size": 2, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 16},
    {"world_size": 2, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 64},  # a step in one
    {"world_size": 4, "megatron": {"pipeline_parallel": 2}, "micro_batch_size": 4},
    {"world_size": 4, "micro_batch_size": 16,
     "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2, "distributed_optimizer": True}},
])
def test_the_megatron_backend_runs_what_it_supports(write_experiment, update):
    """The micro-batch rule holds only with pipeline stages, and a divisor (or a size over a step's
    rows: one micro-batch) passes it; the layouts that divide the ranks load."""
    exp = config.load(write_experiment(update={"backend": "megatron", **update}))
    assert exp.update.backend == "megatron" and exp.update.micro_batch_size == update["micro_batch_size"]


def test_the_megatron_rank_layout_follows_megatrons_order():
    """config_megatron.describe (the dry run prints it): tensor-parallel rank fastest, then the
    data-parallel replica, then the pipeline stage (megatron's "tp-cp-ep-dp-pp"); each stage's ranks and
    nodes as spans; a tensor-parallel group wider than a node is pointed out. The update job's nodes
    are executor.update.nodes only for staged jobs on Slurm (else one)."""
    from hpcrl import config_megatron
    from hpcrl.config_megatron import MegatronConfig, rank_of

    m = MegatronConfig(tensor_parallel=2, pipeline_parallel=3)
    grid = {(t, d, p): rank_of(t, d, p, m, 2) for t in range(2) for d in range(2) for p in range(3)}
    assert sorted(grid.values()) == list(range(12))
    assert [grid[(t, 0, 0)] for t in range(2)] == [0, 1] and grid[(0, 1, 0)] == 2 and grid[(0, 0, 1)] == 4
    assert grid[(1, 1, 2)] == 11

    exp = config.load(Path(__file__).resolve().parents[1] / "configs" / "gsm8k-72b-megatron.toml")
    assert (exp.executor.mode, exp.executor.kind, exp.executor.update.nodes) == ("staged", "slurm", 4)
    exp.update.world_size = 16
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 2, 2
    assert config_megatron.describe(exp) == [  # 2 x 2 x 4 replicas over 4 nodes of 4 ranks
        "update: Megatron-Core, tensor parallel 2 x pipeline parallel 2 x 4 data-parallel replica(s) = 16 "
        "ranks on 4 node(s)",
        "  pipeline stage 0: ranks 0-7 on node(s) 0-1",
        "  pipeline stage 1: ranks 8-15 on node(s) 2-3"]
    exp.update.megatron.tensor_parallel = 4  # a tensor-parallel group of a whole node: no note
    assert config_megatron.describe(exp)[1:] == [
        "  pipeline stage 0: ranks 0-7 on node(s) 0-1",
        "  pipeline stage 1: ranks 8-15 on node(s) 2-3"]
    exp.update.world_size = 24
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 8, 3
    assert config_megatron.describe(exp) == [  # 8 x 3 x 1 over 4 nodes of 6 ranks
        "update: Megatron-Core, tensor parallel 8 x pipeline parallel 3 x 1 data-parallel replica(s) = 24 "
        "ranks on 4 node(s)",
        "  pipeline stage 0: ranks 0-7 on node(s) 0-1",
        "  pipeline stage 1: ranks 8-15 on node(s) 1-2",
        "  pipeline stage 2: ranks 16-23 on node(s) 2-3",
        "  note: a tensor-parallel group of 8 ranks spans nodes of 6 ranks: every layer's all-reduce "
        "crosses the network"]
    exp.executor.update.nodes = 2
    exp.update.world_size = 8
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 1, 2
    assert config_megatron.describe(exp)[1:] == [  # 1 x 2 x 4: stage 0 ranks 0-3 and stage 1 ranks 4-7
        "  pipeline stage 0: ranks 0-3 on node(s) 0",
        "  pipeline stage 1: ranks 4-7 on node(s) 1"]
    exp.executor.update.nodes = 4  # nodes of 2 ranks: a tensor-parallel group of 4 spans two
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 4, 2
    assert config_megatron.describe(exp)[1:] == [
        "  pipeline stage 0: ranks 0-3 on node(s) 0-1",
        "  pipeline stage 1: ranks 4-7 on node(s) 2-3",
        "  note: a tensor-parallel group of 4 ranks spans nodes of 2 ranks: every layer's all-reduce "
        "crosses the network"]
    exp.update.world_size = 2  # fewer ranks than nodes: one a node
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 2, 1
    assert config_megatron.describe(exp)[1:] == [
        "  pipeline stage 0: ranks 0-1 on node(s) 0-1",
        "  note: a tensor-parallel group of 2 ranks spans nodes of 1 ranks: every layer's all-reduce "
        "crosses the network"]
    exp.update.world_size = 8
    exp.update.megatron.tensor_parallel, exp.update.megatron.pipeline_parallel = 4, 2
    exp.executor.kind = "local"  # one machine, whatever executor.update.nodes says
    assert config_megatron.describe(exp) == [
        "update: Megatron-Core, tensor parallel 4 x pipeline parallel 2 x 1 data-parallel replica(s) = 8 "
        "ranks on 1 node(s)",
        "  pipeline stage 0: ranks 0-3 on node(s) 0",
        "  pipeline stage 1: ranks 4-7 on node(s) 0"]


@pytest.mark.parametrize(("values", "text"), [
    ([], ""), ([3], "3"), ([0, 1], "0-1"), ([0, 2], "0,2"), ([0, 1, 2, 5], "0-2,5"),
    ([1, 3, 4, 5, 7, 9, 10], "1,3-5,7,9-10"),
])
def test_rank_spans_print_each_run_of_consecutive_ranks_once(values, text):
    from hpcrl.config_megatron import _spans

    assert _spans(values) == text


def test_a_model_the_megatron_layout_does_not_split_is_refused_before_any_job(write_experiment):
    """The tiny model's 4 key/value heads over 8 tensor-parallel ranks (hpcrl.megatron_convert.check)."""
    exp = config.load(write_experiment(update={"backend": "megatron", "world_size": 8,
                                               "megatron": {"tensor_parallel": 8}}))
    with pytest.raises(ConfigError, match=r"update\.megatron: .*: num_key_value_heads=4 does not split "
                                          r"evenly over 8 tensor-parallel ranks"):
        preflight.check(exp, "e.toml")


def test_a_config_rewritten_in_place_is_read_again_and_loads_share_nothing(write_experiment, monkeypatch):
    """config.load parses each text once (a resident job's stages load the run's config every
    iteration): a file rewritten within the same clock tick, to the same length, must still be read
    as it is now, and a validation that changed the mapping it was given in place must not change
    what the next load of the same text parses."""
    path = write_experiment(update={"lr": 1e-4})
    config.load(path)
    path.write_text(path.read_text().replace("lr = 0.0001", "lr = 0.0002"))
    assert config.load(path).update.lr == 2e-4
    parse = config.parse

    def parse_in_place(data, source, base_dir):  # as a "before" validator rewriting its input would
        data["update"]["lr"] = 9.0
        return parse(data, source, base_dir)

    monkeypatch.setattr(config, "parse", parse_in_place)
    assert config.load(path).update.lr == 9.0
    monkeypatch.setattr(config, "parse", parse)
    assert config.load(path).update.lr == 2e-4


@pytest.mark.parametrize("url, says", [
    ("hooks.example.org/T0", "expected an http:// or https:// URL with a host, e.g. https://host.example.org:8443/path"),
    ("ftp://rm/score", "expected an http:// or https:// URL with a host"),
    ("http://:8000/score", "expected an http:// or https:// URL with a host"),
    ("https://rm:99999/x", "expected an http:// or https:// URL with a valid port"),
    ("http://rm:port/x", "expected an http:// or https:// URL with a valid port"),
])
def test_every_url_key_takes_an_http_url_or_nothing(tmp_path, url, says):
    exp = config.parse({"model": {"path": "/m"}, "data": {"train": "/t.parquet"}}, "test", tmp_path)
    for key in ("reward.http.url", "alerts.webhook", "executor.notify.webhook"):
        with pytest.raises(ConfigError, match=re.escape(f"{key}: Value error, {says}")):
            config.with_overrides(exp, {key: url}, "test")
        for fine in ("", "http://rm-node:8000/score", "https://hooks.example.org/T0"):
            assert config.with_overrides(exp, {key: fine}, "test") is not None


def test_each_load_of_a_file_is_its_own_experiment(tmp_path):
    """pins: config.load parses a file's text once (every resident stage loads the frozen config),
    but a caller that changes what it got changes no later load."""
    path = tmp_path / "e.toml"
    path.write_text('[model]\npath = "m"\n[data]\ntrain = "t.parquet"\n[reward]\n'
                    'functions = ["hpcrl.rewards:exact_match"]\n', encoding="utf-8")
    first = config.load(path)
    first.reward.functions.append("other:reward")
    first.model.path = "elsewhere"
    again = config.load(path)
    assert again.reward.functions == ["hpcrl.rewards:exact_match"]
    assert again.model.path == str(tmp_path / "m")
    data = config._parse_toml(path.read_text(encoding="utf-8"))
    copied = config._copied(data)
    assert copied == data and copied["reward"]["functions"] is not data["reward"]["functions"]
