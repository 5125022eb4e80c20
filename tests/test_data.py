"""Prompt datasets: verl's GSM8K parquet as is, HF `datasets` directories, and the length filter
that preflight and the generate stage share."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hpcrl import config, data, preflight
from hpcrl.config import ConfigError
from tests.conftest import load_tool, stand_in_model

# A template unlike the tiny task's own, so a match proves the tokenizer's template was applied.
TUTOR_TEMPLATE = (
    "{{ '<|im_start|>system\\nYou are a math tutor.<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGE = pa.struct([("content", pa.string()), ("role", pa.string())])
GSM8K_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()),
                              ("split", pa.string())])),
])
QUESTIONS = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
     "in April and May.\n#### 72"),
    ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
     "How much did she earn?",
     "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
     "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"),
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def prepare_gsm8k():
    return load_tool("prepare_gsm8k")


def gsm8k_rows(n: int, split: str = "train") -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for i in range(n):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"content": f"{question} {INSTRUCTION}", "role": "user"}],
            "ability": "math",
            "reward_model": {"ground_truth": answer.split("#### ")[1], "style": "rule"},
            "extra_info": {"answer": answer, "index": i, "question": question, "split": split},
        })
    return rows


@pytest.fixture
def tutor_tokenizer(tiny_task, tmp_path):
    """A copy of the tiny task's tokenizer (and model config) with another chat template."""
    from transformers import AutoTokenizer

    out = tmp_path / "tutor-model"
    out.mkdir()
    shutil.copy(tiny_task / "model" / "config.json", out / "config.json")
    tok = AutoTokenizer.from_pretrained(tiny_task / "model")
    tok.chat_template = TUTOR_TEMPLATE
    tok.save_pretrained(out)
    return out


def test_verl_gsm8k_parquet_is_read_as_is_and_rendered_with_the_tokenizers_chat_template(
        tmp_path, tutor_tokenizer, write_experiment, tiny_task):
    from transformers import AutoTokenizer

    path = tmp_path / "gsm8k-train.parquet"
    pq.write_table(pa.Table.from_pylist(gsm8k_rows(4), GSM8K_SCHEMA), path)
    prompts = data.load_prompts(path)
    assert prompts.column_names == ["data_source", "prompt", "ground_truth"]
    assert prompts["data_source"].to_pylist() == ["openai/gsm8k"] * 4
    assert prompts["ground_truth"].to_pylist() == ["72", "10", "72", "10"]
    tok = AutoTokenizer.from_pretrained(tutor_tokenizer)
    assert data.render(tok, prompts["prompt"][1].as_py()) == (
        "<|im_start|>system\nYou are a math tutor.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTIONS[1][0]} {INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    # the whole config path: preflight accepts it and the prompt set keeps every row
    model = stand_in_model(tiny_task, tmp_path / "model")
    exp = config.load(write_experiment(model={"path": str(model), "tokenizer": str(tutor_tokenizer),
                                              "max_model_len": 512},
                                       data={"train": str(path), "test": str(path)},
                                       algorithm={"prompts_per_iteration": 4}, update={"mini_batches": 1}))
    assert preflight.check(exp, "e.toml") == []
    assert data.prompt_set(exp, "train").table.equals(prompts)


def test_the_gsm8k_preparation_script_writes_what_verl_writes(tmp_path):
    prepare = prepare_gsm8k().prepare
    raw = pa.table({"question": [q for q, _ in QUESTIONS] * 2 + ["Sum 1,000 and 234?"],
                    "answer": [a for _, a in QUESTIONS] * 2 + ["1,000 + 234 = 1,234\n#### 1,234"]})
    pq.write_table(raw, tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(raw.slice(0, 2), tmp_path / "test-00000-of-00001.parquet")
    train, test = prepare(tmp_path / "train-00000-of-00001.parquet", tmp_path / "test-00000-of-00001.parquet",
                          tmp_path / "gsm8k")
    table = pq.read_table(train)
    assert table.num_rows == 5 and pq.read_table(test).num_rows == 2
    expected = gsm8k_rows(4)
    for got, want in zip(table.to_pylist()[:4], expected, strict=True):
        assert got == want
    assert table.to_pylist()[4]["reward_model"] == {"style": "rule", "ground_truth": "1234"}
    assert data.load_prompts(train)["ground_truth"].to_pylist() == ["72", "10", "72", "10", "1234"]


def test_preparation_refuses_an_answer_without_a_final_number(tmp_path):
    tool = prepare_gsm8k()
    with pytest.raises(tool.PrepareError,
                       match=r"raw\.parquet: row 1: the answer has no '#### <number>' line"):
        tool.convert(pa.table({"question": ["a", "b"], "answer": ["#### 1", "no number"]}), "train",
                     "raw.parquet")


def test_hf_datasets_save_to_disk_directories_load(tmp_path, write_experiment, tiny_task):
    import datasets
    rows = gsm8k_rows(10)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "validation": datasets.Dataset.from_list(gsm8k_rows(3, "test"))}
                         ).save_to_disk(str(tmp_path / "dict"))
    from_parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows, GSM8K_SCHEMA), from_parquet)
    assert data.load_prompts(tmp_path / "one").equals(data.load_prompts(from_parquet))
    assert data.load_prompts(tmp_path / "dict", split="validation").num_rows == 3
    with pytest.raises(data.DatasetError, match=r"DatasetDict with the splits \['train', 'validation'\], "
                                                r"none named 'test'; choose one with data\.train_split / "
                                                r"data\.test_split"):
        data.load_prompts(tmp_path / "dict", split="test")
    with pytest.raises(data.DatasetError, match="not one written by datasets' save_to_disk"):
        data.load_prompts(tmp_path)
    # in a config: one directory for both splits, the test split named
    model = stand_in_model(tiny_task, tmp_path / "model")
    exp = config.load(write_experiment(model={"path": str(model), "max_model_len": 512},
                                       data={"train": str(tmp_path / "dict"), "test": str(tmp_path / "dict"),
                                             "test_split": "validation"}))
    preflight.check(exp, "e.toml")
    assert data.prompt_set(exp, "test").table.num_rows == 3


def _addition_prompts(tmp_path, n_short: int = 24, n_long: int = 8):
    """Chat prompts; the long ones ("12+12+...", 68 tokens) do not fit the tiny task's 64 - 8 = 56."""
    short = [f"{10 + i}+{20 + i}=" for i in range(n_short)]
    long = ["+".join(["12"] * 20) + f"+{i}=" for i in range(n_long)]
    texts = [s for pair in zip(short, long, strict=False) for s in pair] + short[n_long:]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t}], "answer": "0"}) + "\n"
                            for t in texts))
    return path, short, long


def test_overlong_prompts_are_dropped_with_a_count_or_refused(tmp_path, write_experiment):
    path, short, long = _addition_prompts(tmp_path)
    exp = config.load(write_experiment(data={"train": str(path), "test": str(path)}))
    notes = preflight.check(exp, "e.toml")
    assert notes == [f"data.{s}: {path}: dropped 8 of 32 prompts longer than model.max_model_len - "
                     "generate.max_tokens = 56 tokens (data.filter_overlong)" for s in ("train", "test")]
    kept = [json.loads(p)[0]["content"] for p in data.prompt_set(exp, "train").table["prompt"].to_pylist()]
    assert kept == short  # dataset order, long ones gone
    refusing = config.with_overrides(exp, {"data.filter_overlong": False}, "e.toml")
    with pytest.raises(ConfigError, match=r"data\.train: .*mixed\.jsonl: 8 of 32 prompts longer than "
                                          r"model\.max_model_len - generate\.max_tokens = 56 tokens; "
                                          r"drop them with data\.filter_overlong = true"):
        preflight.check(refusing, "e.toml")
    assert data.prompt_set(refusing, "train").table.num_rows == 32


def test_a_prompt_set_is_read_once_per_process_until_its_file_changes(tmp_path, write_experiment):
    """pins: a resident generator's every iteration reuses the set; a rewritten dataset reads again."""
    path, short, _ = _addition_prompts(tmp_path)
    exp = config.load(write_experiment(data={"train": str(path), "test": str(path)}))
    first = data.prompt_set(exp, "train")
    assert data.prompt_set(exp, "train") is first
    assert data.prompt_set(exp, "test") is not first  # another split, another entry
    rows = path.read_text().splitlines()
    path.write_text("\n".join(rows[:-1] + rows[:1]) + "\n")  # a row swapped: same size, new content
    os.utime(path, ns=(1, 1))
    again = data.prompt_set(exp, "train")
    assert again is not first and again.table.num_rows == first.table.num_rows
    assert again.table["prompt"][-1] == again.table["prompt"][0] != first.table["prompt"][-1]


def test_too_few_prompts_left_after_the_filter(tmp_path, write_experiment):
    path, _, _ = _addition_prompts(tmp_path, n_short=8, n_long=8)
    exp = config.load(write_experiment(data={"train": str(path)}, algorithm={"prompts_per_iteration": 12},
                                       update={"mini_batches": 1}))
    with pytest.raises(ConfigError, match=r"data\.train: .*8 prompts \(after dropping 8 too long\), "
                                          r"fewer than algorithm\.prompts_per_iteration = 12"):
        preflight.check(exp, "e.toml")


def test_the_generate_stage_never_draws_a_filtered_prompt(tmp_path, write_experiment, tiny_task, monkeypatch):
    from transformers import AutoTokenizer

    from hpcrl.generation import train_requests, val_requests

    monkeypatch.delenv("HPCRL_CACHE_DIR")  # the default cache, under runs_root
    path, short, long = _addition_prompts(tmp_path)
    exp = config.load(write_experiment(data={"train": str(path), "test": str(path), "max_val_prompts": 0},
                                       run={"iterations": 12, "eval_every": 4}))
    preflight.check(exp, "e.toml")  # measures the lengths once and caches them under runs_root
    cached = list((tmp_path / "runs" / ".cache" / "prompt-lengths").glob("*.parquet"))
    assert len(cached) == 1 and pq.read_table(cached[0]).num_rows == 32

    tok = AutoTokenizer.from_pretrained(tiny_task / "model")  # what the stage gets from vLLM, for rendering

    def no_tokenizer(*a, **k):
        raise AssertionError("the stage should reuse the cached prompt lengths")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_tokenizer)
    drawn, validated = set(), set()
    for k in range(exp.run.iterations + 1):
        train, val = train_requests(exp, k, tok), val_requests(exp, k, tok)
        drawn |= {r.prompt_text for r in train}
        validated |= {r.prompt_text for r in val}
    expect = {data.render(tok, json.dumps([{"role": "user", "content": s}])) for s in short}
    assert drawn == expect  # 12 iterations x 8 prompts cover every kept prompt, and nothing else
    assert validated == expect


def test_a_submit_that_finds_its_measurements_cached_does_not_load_the_tokenizer(tmp_path, write_experiment,
                                                                                  tiny_task, monkeypatch):
    monkeypatch.setenv("HPCRL_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_task / "model", model)
    exp = config.load(write_experiment(model={"path": str(model)}))
    loaded = []
    real = data.load_tokenizer
    monkeypatch.setattr(data, "load_tokenizer", lambda e: loaded.append(e) or real(e))
    preflight.check(exp, "e.toml")
    assert len(loaded) == 1  # measured once: the tokenizer's facts, then both splits' lengths with it
    facts = json.loads(next((tmp_path / "cache" / "tokenizers").glob("*.json")).read_text())
    assert facts == {"tokens": len(real(exp)), "eos_token_id": real(exp).eos_token_id}
    preflight.check(exp, "e.toml")
    assert len(loaded) == 1
    config_path = model / "tokenizer_config.json"  # a changed tokenizer is measured again
    config_path.write_text(config_path.read_text().replace("{", '{"model_max_length": 77, ', 1))
    preflight.check(exp, "e.toml")
    assert len(loaded) == 2
    facts["eos_token_id"] = None  # what a tokenizer without one would have cached: refused, from the cache
    for stale in (tmp_path / "cache" / "tokenizers").glob("*.json"):
        stale.write_text(json.dumps(facts))
    with pytest.raises(ConfigError, match="has no eos token"):
        preflight.check(exp, "e.toml")
    assert len(loaded) == 2
