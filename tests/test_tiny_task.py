"""The tiny demo task built by tools/build_tiny_task.py: data layout, tokenizer, warm-start accuracy.

Uses the session fixture `tiny_task` (tests/conftest.py), which builds the default cache only when it
is missing or stale; with the cache present these tests take a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "tools" / "build_tiny_task.py"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_tiny_task", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def record(tiny_task: Path) -> dict:
    return json.loads((tiny_task / "BUILD.json").read_text())


def read_split(task: Path, split: str) -> list[dict]:
    return pq.read_table(task / "data" / f"{split}.parquet").to_pylist()


def test_parquet_layout_is_verl_like(tiny_task: Path, record: dict):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    expected = pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ])
    for split, size in (("train", record["params"]["n_train"]), ("test", record["params"]["n_test"])):
        assert pq.read_schema(tiny_task / "data" / f"{split}.parquet").remove_metadata() == expected
        rows = read_split(tiny_task, split)
        assert len(rows) == size
        terms = []
        for i, row in enumerate(rows):
            assert row["data_source"] == "tiny_addition" and row["ability"] == "math"
            assert row["extra_info"] == {"split": split, "index": i}
            [msg] = row["prompt"]
            assert msg["role"] == "user" and msg["content"].endswith("=")
            operands = [int(x) for x in msg["content"][:-1].split("+")]
            assert all(10 <= x <= 99 for x in operands)
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(sum(operands))}
            terms.append(len(operands))
        assert sorted(set(terms)) == [2, 3]
        assert terms.count(3) == round(size * record["params"]["three_term_fraction"])


def test_train_and_test_prompts_are_disjoint(tiny_task: Path):
    train, test = ({r["prompt"][0]["content"] for r in read_split(tiny_task, s)} for s in ("train", "test"))
    assert (len(train) == len(read_split(tiny_task, "train"))
            and len(test) == len(read_split(tiny_task, "test")))
    assert not train & test


def test_auto_tokenizer_matches_the_trained_bpe(tiny_task: Path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(tiny_task / "model" / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tiny_task / "model")
    assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"
    prompt = auto.apply_chat_template([{"role": "user", "content": "37+45="}], tokenize=False,
                                      add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n37+45=<|im_end|>\n<|im_start|>assistant\n"
    for text in (prompt + "82<|im_end|>", prompt + "0082<|im_end|>", "Hi, there!  42\n\n ü x", " a  b "):
        ids = raw.encode(text).ids
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids) == text
    assert all(len(raw.encode(d).ids) == 1 for d in "0123456789")
    assert raw.encode("<|im_end|>").ids == [auto.eos_token_id]


def test_build_record_meets_the_targets(tiny_task: Path, record: dict, builder):
    assert record["hash"] == builder.build_hash(), "stale cache: the fixture should have rebuilt it"
    acc = record["accuracy"]
    assert acc["sft"]["by_terms"]["2"]["greedy"] >= 0.9  # the supervised pass taught two-term sums
    pairs, triples = acc["by_terms"]["2"], acc["by_terms"]["3"]
    assert 0.03 <= pairs["greedy"] <= 0.25  # after the format pass: low but not zero
    assert pairs["greedy_stripped"] >= 0.7  # the sums are mostly right, written zero-padded
    assert triples["greedy_stripped"] <= 0.2  # three-term sums: the hard kind, rarely solved
    config = json.loads((tiny_task / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["dtype"] == "float32"
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64)  # vLLM CPU attention sizes
    assert 200_000 <= record["n_params"] <= 1_000_000
    assert (tiny_task / "model" / "model.safetensors").is_file()


def test_saved_model_reproduces_the_recorded_accuracy(tiny_task: Path, record: dict, builder):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    raw = Tokenizer.from_file(str(tiny_task / "model" / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float32)
    test = [tuple(map(int, r["prompt"][0]["content"][:-1].split("+"))) for r in read_split(tiny_task, "test")]
    result = builder.evaluate(model, raw, test)
    assert result["greedy"] == pytest.approx(record["accuracy"]["greedy"], abs=1 / len(test))
    assert (result["greedy_stripped"]
            == pytest.approx(record["accuracy"]["greedy_stripped"], abs=1 / len(test)))


def test_second_build_is_a_cache_hit(tiny_task: Path):
    """A second build with the same recipe rewrites nothing."""
    files = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(tiny_task.rglob("*")) if p.is_file()}
    proc = subprocess.run([sys.executable, str(BUILDER), "--out", str(tiny_task)], check=True,
                          capture_output=True, text=True)
    assert "up to date" in proc.stdout
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(tiny_task.rglob("*"))
            if p.is_file()} == files
