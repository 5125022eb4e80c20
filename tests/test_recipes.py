"""The GSM8K recipes in configs/ pass `hpcrl submit --dry-run` and their sbatch scripts carry the
recipe's resources.

The recipes name real models and data that are not here (no GPUs, no Qwen weights), so each test
copies a recipe into a directory tree laid out like the repository and puts stand-ins at the
recipe's relative paths: a model directory with the tiny task's config and tokenizer, and GSM8K
data made by tools/prepare_gsm8k.py from synthetic raw files. Preflight runs for real on them.
"""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl import config
from tests.conftest import stand_in_model

REPO = Path(__file__).resolve().parents[1]
N_TRAIN, N_LONG, N_TEST = 1100, 3, 40


def _raw_gsm8k(n: int, n_long: int = 0) -> pa.Table:
    """Rows shaped like openai/gsm8k `main`: a question and a worked answer ending in "#### N"."""
    questions, answers = [], []
    for i in range(n):
        a, b = 3 + i % 50, 7 + i % 13
        questions.append(f"Tom has {a} apples and buys {b} more. How many apples does Tom have now?")
        answers.append(f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}")
    for i in range(n_long):  # about 900 tokens with the tiny tokenizer: over the recipes' 512
        questions.append("Tom counts apples. " * 45 + f"How many is {i}?")
        answers.append(f"#### {i}")
    return pa.table({"question": questions, "answer": answers})


@pytest.fixture(scope="module")
def gsm8k_data(tmp_path_factory) -> Path:
    """data/gsm8k/{train,test}.parquet as tools/prepare_gsm8k.py writes them."""
    root = tmp_path_factory.mktemp("gsm8k")
    pq.write_table(_raw_gsm8k(N_TRAIN, N_LONG), root / "train-00000-of-00001.parquet")
    pq.write_table(_raw_gsm8k(N_TEST), root / "test-00000-of-00001.parquet")
    out = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_gsm8k.py"),
                          "--train", str(root / "train-00000-of-00001.parquet"),
                          "--test", str(root / "test-00000-of-00001.parquet"), "--out", str(root / "data")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"train.parquet: {N_TRAIN + N_LONG} rows" in out.stdout
    return root / "data"


def _tree(recipe: str, tmp_path: Path, tiny_task: Path, gsm8k_data: Path) -> Path:
    """The recipe at tmp_path/configs/, with stand-ins at its model and data paths."""
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / recipe
    shutil.copy(REPO / "configs" / recipe, path)
    raw = tomllib.loads(path.read_text())
    stand_in_model(tiny_task, (path.parent / raw["model"]["path"]).resolve())
    for split in ("train", "test"):
        dest = (path.parent / raw["data"][split]).resolve()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(gsm8k_data / f"{split}.parquet", dest)
    return path


def _dry_run(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", "--dry-run", str(path)],
                          capture_output=True, text=True, timeout=300)


def _directives(script: Path) -> set[str]:
    return {line.removeprefix("#SBATCH ") for line in script.read_text().splitlines()
            if line.startswith("#SBATCH ")}


@pytest.mark.parametrize("recipe, update_nodes, generate_gpus", [
    ("gsm8k-qwen2.5-0.5b-grpo.toml", 1, 1),
    ("gsm8k-7b-4nodes.toml", 4, 4),
])
def test_grpo_recipe_dry_run_writes_scripts_with_its_resources(recipe, update_nodes, generate_gpus,
                                                              tmp_path, tiny_task, gsm8k_data):
    path = _tree(recipe, tmp_path, tiny_task, gsm8k_data)
    out = _dry_run(path)
    assert out.returncode == 0, out.stderr
    assert "dry run: config, model, tokenizer, data, rewards and batch shape checked" in out.stdout
    assert (f"note: data.train: {path.parent.parent}/data/gsm8k/train.parquet: dropped {N_LONG} of "
            f"{N_TRAIN + N_LONG} prompts longer than model.max_model_len - generate.max_tokens = "
            "512 tokens") in out.stderr
    exp = config.load(path)
    dry = tmp_path / "runs" / "dry-runs" / exp.run.name
    assert f"under {dry} (no run created at {exp.run_dir}; nothing submitted)" in out.stdout
    assert not exp.run_dir.exists()
    sbatch = dry / "sbatch"
    frozen = config.load(dry / "experiment.toml")
    assert frozen.model.dtype == "bfloat16" and frozen.algorithm.kl.estimator == "k3"
    assert len(list(sbatch.glob("iter_*-update.sbatch"))) == exp.run.iterations
    update = _directives(sbatch / "iter_000000-update.sbatch")
    assert {f"--nodes={update_nodes}", "--gpus-per-node=8", "--ntasks-per-node=8", "--requeue"} <= update
    generate = _directives(sbatch / "iter_000000-generate.sbatch")
    assert {"--nodes=1", f"--gpus-per-node={generate_gpus}", "--ntasks-per-node=1"} <= generate
    assert generate_gpus == exp.generate.tensor_parallel_size
    assert not any(d.startswith("--gpus") for d in _directives(sbatch / "iter_000000-score.sbatch"))
    assert "srun" in (sbatch / "iter_000000-update.sbatch").read_text()


def test_the_7b_recipe_shards_the_update_with_zero3_over_32_ranks():
    exp = config.load(REPO / "configs" / "gsm8k-7b-4nodes.toml")
    assert (exp.update.zero_stage, exp.update.world_size, exp.executor.update.nodes) == (3, 32, 4)
    assert exp.model.path.endswith("models/Qwen2.5-7B-Instruct")


def test_ppo_recipe_dry_run(tmp_path, tiny_task, gsm8k_data):
    path = _tree("gsm8k-qwen2.5-0.5b-ppo.toml", tmp_path, tiny_task, gsm8k_data)
    exp = config.load(path)
    assert (exp.algorithm.name, exp.algorithm.group_size, exp.algorithm.critic.lr) == ("ppo", 1, 1e-5)
    out = _dry_run(path)
    assert out.returncode == 0, out.stderr
    dry = exp.run_dir.parent / "dry-runs" / exp.run.name
    assert "--gpus-per-node=8" in (dry / "sbatch" / "iter_000000-update.sbatch").read_text()


def test_the_72b_megatron_recipe_dry_run_renders_its_ranks_over_four_nodes(tmp_path, tiny_task, gsm8k_data):
    """Issue #21: TP 8 within each node, PP 4 across the 4 nodes of the update job. The stand-in
    model claims Qwen2.5-72B's layout (80 layers, 64 query and 8 key/value heads) over the tiny
    weights, so preflight's layout check (hpcrl.megatron_convert.check) runs on it."""
    import json

    path = _tree("gsm8k-72b-megatron.toml", tmp_path, tiny_task, gsm8k_data)
    model = (path.parent / tomllib.loads(path.read_text())["model"]["path"]).resolve()
    cfg = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k != "layer_types"}
    layout = {**cfg, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    (model / "config.json").write_text(json.dumps(layout))
    out = _dry_run(path)
    assert out.returncode == 0, out.stderr
    assert ("update: Megatron-Core, tensor parallel 8 x pipeline parallel 4 x 1 data-parallel replica(s) "
            "= 32 ranks on 4 node(s)") in out.stdout
    for stage in range(4):
        assert f"pipeline stage {stage}: ranks {8 * stage}-{8 * stage + 7} on node(s) {stage}" in out.stdout
    assert "spans nodes" not in out.stdout
    exp = config.load(path)
    sbatch = tmp_path / "runs" / "dry-runs" / exp.run.name / "sbatch"
    assert {"--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=8"} <= _directives(
        sbatch / "iter_000000-update.sbatch")
    assert {"--nodes=1", "--gpus-per-node=8"} <= _directives(sbatch / "iter_000000-generate.sbatch")
    (model / "config.json").write_text(json.dumps({**layout, "num_hidden_layers": 78}))  # not over 4 stages
    refused = _dry_run(path)
    assert refused.returncode != 0 and "num_hidden_layers=78 does not split evenly over 4" in refused.stderr

