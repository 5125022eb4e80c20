"""Bad files refused by `hpcrl submit --dry-run` before any job starts: a damaged model directory,
prompts that cannot be rendered, a reward module that fails at import. Each refusal exits 2, names
the file, the key and what was expected, in one error, without a traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _dry_run(path):
    from click.testing import CliRunner

    from hpcrl.cli import main

    return CliRunner().invoke(main, ["submit", "--dry-run", str(path)])


def _refused(result, path, says):
    assert result.exit_code == 2, result.output
    assert str(path) in result.stderr and says in result.stderr, result.stderr
    assert "Traceback" not in result.output


def _truncate(model: Path):
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])


def _shard_index(model: Path, shard: str):
    names = json.loads((model / "model.safetensors").read_bytes()[8:][
        : int.from_bytes((model / "model.safetensors").read_bytes()[:8], "little")])
    names.pop("__metadata__", None)
    index = {"metadata": {}, "weight_map": {name: shard for name in names}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model.safetensors").unlink()


def _resize_vocab(model: Path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] += 64
    (model / "config.json").write_text(json.dumps(cfg))


BAD_MODELS = [  # (what is done to a copy of the tiny model, what the error says)
    (lambda m: (m / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda m: (m / "config.json").write_text("[1, 2]"), "config.json: expected a JSON object"),
    (lambda m: (m / "model.safetensors").unlink(), "no weights (expected model.safetensors"),
    (_truncate, "model.safetensors: not a complete safetensors file"),
    (lambda m: _shard_index(m, "model-00001-of-00002.safetensors"),
     "names model-00001-of-00002.safetensors, which is missing"),
    (_resize_vocab, "config.json says vocab_size = 339 but the weights' embedding has 275 rows"),
    (lambda m: [(m / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
     "no tokenizer files (expected one of tokenizer.json"),
]


@pytest.mark.parametrize("damage, says", BAD_MODELS, ids=[s for _, s in BAD_MODELS])
def test_a_damaged_model_directory_is_refused(write_experiment, tiny_task, tmp_path, damage, says):
    model = tmp_path / "model"
    shutil.copytree(tiny_task / "model", model)
    damage(model)
    path = write_experiment("bad", model={"path": str(model), "max_model_len": 64})
    _refused(_dry_run(path), path, says)


def test_max_model_len_beyond_the_models_positions_is_refused(write_experiment):
    path = write_experiment("bad", model={"max_model_len": 4096})
    _refused(_dry_run(path), path, "model.max_model_len: 4096 is more than the model's "
             "max_position_embeddings = 64")


def test_a_kv_cache_larger_than_the_machine_is_refused(write_experiment):
    path = write_experiment("bad", generate={"kv_cache_gib": 1e6})
    _refused(_dry_run(path), path, "generate.kv_cache_gib: 1000000.0 GiB of KV cache does not fit")


def _prompts(tmp_path, prompts, name="train.parquet") -> Path:
    out = tmp_path / name
    pq.write_table(pa.table({"prompt": prompts, "answer": ["1"] * len(prompts)}), out)
    return out


BAD_PROMPTS = [  # (the prompt column, what the error says)
    (pa.array(["1+1=", None] * 8, pa.string()), "prompt 1 is null"),
    (pa.array([b"1+1=", b"\xff\xfe"] * 8, pa.binary()), "column 'prompt' has type binary"),
    (pa.array([[{"role": "user", "content": None}]] * 16,
              pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
     "prompt 0: message 0 has no content or role"),
    (pa.array([None] * 16, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
     "prompt 0 is null"),
]


@pytest.mark.parametrize("column, says", BAD_PROMPTS, ids=[s for _, s in BAD_PROMPTS])
def test_prompts_that_cannot_be_rendered_are_refused(write_experiment, tmp_path, column, says):
    train = _prompts(tmp_path, column)
    path = write_experiment("bad", data={"train": str(train), "test": str(train), "answer_key": "answer"})
    _refused(_dry_run(path), path, says)


def test_a_jsonl_dataset_that_is_not_utf8_is_refused(write_experiment, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_bytes(b'{"prompt": "1+1=\xff", "answer": "2"}\n' * 16)
    path = write_experiment("bad", data={"train": str(train), "test": str(train), "answer_key": "answer"})
    _refused(_dry_run(path), path, f"data.train: {train}: cannot be read as jsonl")


def test_a_reward_module_that_raises_at_import_is_refused(write_experiment, tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('no licence server')\n"
                                               "def score(batch):\n    return [0.0] * len(batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_experiment("bad", reward={"functions": ["broken_rewards:score"]})
    _refused(_dry_run(path), path, "reward.functions: reward function 'broken_rewards:score': importing "
             "broken_rewards raised RuntimeError: no licence server")


# ---- the run directory ------------------------------------------------------------------------

def _invoke(*args):
    from click.testing import CliRunner

    from hpcrl.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def small_run(tmp_path):
    from tests.synthetic_run import make_run

    return make_run(tmp_path / "runs" / "r", iterations=1, rows=32, val_rows=8).root


@pytest.mark.parametrize("file, content, says", [
    ("iter_000001/generate/_COMMIT.json", "{oops", "_COMMIT.json: damaged, not valid JSON"),
    ("run.json", "[]", "run.json: damaged, expected a JSON object, found a list"),
], ids=["manifest", "run.json"])
def test_a_damaged_run_file_is_named_without_a_traceback(small_run, file, content, says):
    (small_run / file).write_text(content)
    for command in (("status", small_run), ("status", "--verify", small_run), ("inspect", small_run)):
        result = _invoke(*command)
        assert result.exit_code == 1 and says in result.stderr, (command, result.output)
        assert "Traceback" not in result.output


def test_a_directory_that_is_not_a_run_is_not_adopted(write_experiment, tmp_path):
    (tmp_path / "runs" / "theirs").mkdir(parents=True)
    (tmp_path / "runs" / "theirs" / "notes.txt").write_text("mine")
    path = write_experiment("theirs")
    result = _invoke("submit", path)
    _refused(result, path, f"run.name: {tmp_path / 'runs' / 'theirs'} exists and is not an hpcrl run")
    assert sorted(p.name for p in (tmp_path / "runs" / "theirs").iterdir()) == ["notes.txt"]


def test_a_submission_sbatch_refuses_leaves_no_run_behind(write_experiment, tmp_path, monkeypatch):
    """sbatch stands in as a script that refuses: the test is about hpcrl's clean-up, not Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    path = write_experiment("refused", executor={"kind": "slurm"})
    result = _invoke("submit", path)
    assert result.exit_code == 1 and "could not submit the controller job" in result.stderr, result.output
    assert "no run was created" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "runs" / "refused").exists()


def test_a_full_disk_is_named_and_leaves_no_half_made_run(write_experiment, tmp_path, monkeypatch):
    """The disk fills while the run is created (ENOSPC injected into the config's freeze)."""
    import errno

    from hpcrl import runs

    def full(run, exp):
        raise OSError(errno.ENOSPC, "No space left on device", str(run.config_path))

    monkeypatch.setattr(runs, "_freeze", full)
    path = write_experiment("full")
    result = _invoke("submit", path)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "experiment.toml: no space left on the disk (or the quota is used up)" in result.stderr
    assert not (tmp_path / "runs" / "full").exists()


def test_an_unexpected_error_is_one_line_and_its_traceback_goes_to_a_log(write_experiment, tmp_path,
                                                                         monkeypatch):
    from hpcrl import preflight

    def broken(exp, source):
        raise KeyError("boom")

    monkeypatch.setattr(preflight, "check", broken)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("HPCRL_DEBUG", raising=False)
    result = _invoke("submit", "--dry-run", write_experiment("x"))
    assert result.exit_code == 3 and "Traceback" not in result.output, result.output
    assert result.stderr.startswith("error: unexpected KeyError: 'boom' (the traceback is in ")
    logs = list((tmp_path / "state" / "hpcrl" / "errors").glob("*.log"))
    assert len(logs) == 1 and str(logs[0]) in result.stderr
    text = logs[0].read_text()
    assert "Traceback (most recent call last)" in text and "in broken" in text and "KeyError: 'boom'" in text


def _rewrite_generate_manifest(root: Path, k: int = 0) -> Path:
    """Rewrite iteration k's generate manifest (still valid JSON, its files intact): the score and
    update committed after it were computed from another generate output than the one there now."""
    path = root / f"iter_{k:06d}" / "generate" / "_COMMIT.json"
    manifest = json.loads(path.read_text())
    manifest["metrics"]["edited"] = 1.0
    path.write_text(json.dumps(manifest))
    return path


def test_resume_refuses_a_history_whose_recorded_inputs_changed(small_run):
    _rewrite_generate_manifest(small_run)
    result = _invoke("resume", small_run)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the committed outputs do not form one history; nothing was run" in result.stderr
    assert (f"{small_run / 'iter_000000' / 'score'}: computed from another "
            f"{small_run / 'iter_000000' / 'generate'} than the one committed there now") in result.stderr


def test_a_stage_refuses_an_input_whose_own_inputs_changed(small_run):
    from hpcrl import commit, runs
    from hpcrl.stage import StageContext

    run, exp = runs.open_run(small_run)
    ctx = StageContext(run, exp, "update", 0, 0, writer=None)
    assert ctx.input_dir("generate") == run.stage_dir(0, "generate")  # sound: accepted
    _rewrite_generate_manifest(small_run)
    with pytest.raises(commit.CorruptOutputError, match="input of update: .*score: computed from another"):
        ctx.input_dir("score")
