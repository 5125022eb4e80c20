#!/usr/bin/env python
"""Build the tiny demo task: a small Qwen2 model warm-started on 2-digit addition, plus its data.

Usage: python tools/build_tiny_task.py [--out DIR] [--force]
DIR defaults to $HPCRL_TINY_TASK_DIR, else <repo>/.cache/tiny-addition. It receives:
  model/       Qwen2ForCausalLM (float32, safetensors), byte-level BPE tokenizer, ChatML chat template
  data/        train.parquet and test.parquet (disjoint prompts) in verl's layout
  BUILD.json   parameters, hash of (this script's code + parameters), measured accuracies, library versions

The prompts are sums of 2-digit numbers: three quarters of two terms ("37+45="), one quarter of
three ("12+34+56="), the hard kind. The warm start is three supervised passes:
correct two-term sums until the model gets them right; a short pass with three-term sums and 30%
zero-padded answers mixed in; then a pass where about 60% of the answers are zero-padded to 4
digits ("0082", which earns no reward), in rounds until the targets below are met. The model's
two-term arithmetic stays mostly right while its greedy exact-match accuracy is low but not zero,
so GRPO has a format error to fix; three-term sums it rarely gets right, so the prompts differ in
difficulty and PPO's critic has something to learn (which prompts will fail). The build is
deterministic (fixed seeds and thread count) and cached: when BUILD.json carries the current hash
the script exits before importing anything heavy. Files are written to a temporary directory
beside DIR and renamed into place at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2ForCausalLM

Problem = tuple[int, ...]  # the operands of one sum
REPO = Path(__file__).resolve().parents[1]
DATA_SOURCE = "tiny_addition"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad/unk, turn start, eos
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer regex (digits are split one per token).
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PARAMS: dict[str, Any] = {
    "seed": 1,
    "threads": 2,
    "operand_range": [10, 99],
    "n_train": 2048,
    "n_test": 128,
    "three_term_fraction": 0.25,  # of the RL train and test prompts: "12+34+56=", the harder kind
    "model": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,  # head_dim 32
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 64,
    },
    "batch_size": 128,
    "pad_width": 4,  # the unrewarded format: "0082"
    "passes": {  # supervised passes, in order
        "sft": {"steps": 1000, "lr": 3e-3, "pad_fraction": 0.0, "cosine": True, "three_term_fraction": 0.0},
        # padded answers too, so that the model knows the sums in the padded format
        "three_terms": {"steps": 200, "lr": 1e-3, "pad_fraction": 0.3, "cosine": True,
                        "three_term_fraction": 0.5},
        "format": {"steps": 50, "lr": 3e-4, "pad_fraction": 0.6, "cosine": False,
                   "three_term_fraction": 0.0},
    },
    # The format pass goes on, `steps` at a time, until the greedy exact match on two-term sums is in
    # `pairs_greedy` and their accuracy after stripping leading zeros at least `pairs_stripped`:
    # where a pass ends depends on float rounding, which differs between CPUs.
    "format_target": {"pairs_greedy": [0.05, 0.2], "pairs_stripped": 0.85, "steps": 50,
                      "max_rounds": 30},
}


def default_out() -> Path:
    return Path(os.environ.get("HPCRL_TINY_TASK_DIR") or REPO / ".cache" / "tiny-addition")


def build_hash() -> str:
    """Hash of this script's code (its syntax tree without docstrings: comments and docs do not
    change what is built) and the parameters."""
    import ast

    tree = ast.parse(Path(__file__).read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    blob = ast.dump(tree).encode() + json.dumps(PARAMS, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def is_up_to_date(out: Path) -> bool:
    try:
        return json.loads((out / "BUILD.json").read_text())["hash"] == build_hash()
    except (OSError, ValueError, KeyError):
        return False


def split_problems(rng: random.Random) -> tuple[list[Problem], list[Problem], list[Problem], set[Problem]]:
    """(test, rl_train, sft_pairs, test_triples): disjoint test prompts, a three_term_fraction of them
    three-term sums; the supervised passes draw pairs from sft_pairs (every pair not in test) and
    triples at random, never one of test_triples."""
    lo, hi = PARAMS["operand_range"]
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    rng.shuffle(pairs)
    n3_test, n3_train = (round(PARAMS[k] * PARAMS["three_term_fraction"]) for k in ("n_test", "n_train"))
    test2, rest = pairs[: PARAMS["n_test"] - n3_test], pairs[PARAMS["n_test"] - n3_test :]
    triples: dict[Problem, None] = {}  # insertion-ordered and distinct
    while len(triples) < n3_test + n3_train:
        triples[tuple(rng.randint(lo, hi) for _ in range(3))] = None
    test3, rl3 = list(triples)[:n3_test], list(triples)[n3_test:]
    test, rl_train = test2 + test3, rest[: PARAMS["n_train"] - n3_train] + rl3
    rng.shuffle(test)
    rng.shuffle(rl_train)
    return test, rl_train, rest, set(test3)


def prompt_text(problem: Problem) -> str:
    return "+".join(map(str, problem)) + "="


def write_parquet(path: Path, problems: list[Problem], split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    reward_model = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    extra_info = pa.struct([("split", pa.string()), ("index", pa.int64())])
    schema = pa.schema(
        [("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
         ("reward_model", reward_model), ("extra_info", extra_info)]
    )  # fmt: skip
    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(problem)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(sum(problem))},
            "extra_info": {"split": split, "index": i},
        }
        for i, problem in enumerate(problems)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def train_tokenizer(model_dir: Path) -> Tokenizer:
    """Byte-level BPE with Qwen2's normalizer/pre-tokenizer/decoder; saved so AutoTokenizer agrees."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(["system\n", "user\n", "assistant\n", "0123456789+="] * 8, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    ).save_pretrained(model_dir)
    # Name the class transformers 5 picks for qwen2 anyway; transformers 4 maps it to Qwen2TokenizerFast.
    config_path = model_dir / "tokenizer_config.json"
    config = {**json.loads(config_path.read_text()), "tokenizer_class": "Qwen2Tokenizer"}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    loaded = AutoTokenizer.from_pretrained(model_dir)
    samples = [render_prompt("37+45=") + "82<|im_end|>", "Hello, world!  12345 +=\n\n x ü", " a  b "]
    for text in samples:
        assert loaded(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids, text
        assert loaded.decode(tok.encode(text).ids) == text, text
    assert all(len(tok.encode(d).ids) == 1 for d in "0123456789")
    return tok


def render_prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def encode_batch(
    tok: Tokenizer, problems: list[Problem], answers: list[str] | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids (the problems must have one prompt length), or prompt+answer+eos ids, right-padded,
    with loss labels on the answer and eos."""
    import torch

    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    prompts = [tok.encode(render_prompt(prompt_text(problem))).ids for problem in problems]
    if answers is None:
        return torch.tensor(prompts)
    width = max(map(len, prompts)) + max(map(len, answers)) + 1
    ids = torch.full((len(problems), width), pad)
    labels = torch.full((len(problems), width), -100)
    for row, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        full = prompt + tok.encode(answer).ids + [eos]
        ids[row, : len(full)] = torch.tensor(full)
        labels[row, len(prompt) : len(full)] = ids[row, len(prompt) : len(full)]
    return ids, labels


def draw(rng: random.Random, pairs: list[Problem], test_triples: set[Problem],
         three_term_fraction: float) -> Problem:
    """One supervised example: a three-term sum with probability three_term_fraction, else a pair."""
    if rng.random() >= three_term_fraction:
        return rng.choice(pairs)
    lo, hi = PARAMS["operand_range"]
    while (triple := tuple(rng.randint(lo, hi) for _ in range(3))) in test_triples:
        pass
    return triple


def train(
    model: Qwen2ForCausalLM, tok: Tokenizer, pools: tuple[list[Problem], set[Problem]], rng: random.Random,
    steps: int, lr: float, pad_fraction: float, cosine: bool, three_term_fraction: float,
) -> None:  # fmt: skip
    """AdamW, linear warmup, then cosine decay or constant; a pad_fraction of answers zero-padded."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    decay = (lambda s: 0.5 + 0.5 * math.cos(math.pi * s / steps)) if cosine else (lambda s: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * decay(s))
    model.train()
    for _ in range(steps):
        batch = [draw(rng, *pools, three_term_fraction) for _ in range(PARAMS["batch_size"])]
        width = [PARAMS["pad_width"] if rng.random() < pad_fraction else 0 for _ in batch]
        answers = [str(sum(problem)).zfill(w) for problem, w in zip(batch, width, strict=True)]
        ids, labels = encode_batch(tok, batch, answers)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


def greedy_answers(model: Qwen2ForCausalLM, tok: Tokenizer, problems: list[Problem]) -> list[str]:
    """Greedy answers (up to pad_width + 1 tokens, cut at eos) to problems of one prompt length."""
    import torch

    eos = tok.token_to_id("<|im_end|>")
    ids = encode_batch(tok, problems)
    width = ids.shape[1]
    model.eval()
    with torch.no_grad():
        for _ in range(PARAMS["pad_width"] + 1):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    return [tok.decode(row[: row.index(eos)] if eos in row else row) for row in ids[:, width:].tolist()]


def evaluate(model: Qwen2ForCausalLM, tok: Tokenizer, problems: list[Problem]) -> dict[str, Any]:
    """Greedy decoding: exact-match accuracy and accuracy after stripping leading zeros, overall and
    by number of terms."""
    result: dict[str, Any] = {"by_terms": {}}
    hits = {"greedy": 0, "greedy_stripped": 0}
    for terms in sorted({len(p) for p in problems}):
        group = [p for p in problems if len(p) == terms]
        texts = greedy_answers(model, tok, group)
        truth = [str(sum(p)) for p in group]
        exact = sum(t == g for t, g in zip(texts, truth, strict=True))
        stripped = sum(t.lstrip("0") == g for t, g in zip(texts, truth, strict=True))
        hits["greedy"] += exact
        hits["greedy_stripped"] += stripped
        result["by_terms"][str(terms)] = {"greedy": exact / len(group),
                                          "greedy_stripped": stripped / len(group)}
    return {**{k: v / len(problems) for k, v in hits.items()}, **result}


def build_model(
    tok: Tokenizer, model_dir: Path, test: list[Problem], pools: tuple[list[Problem], set[Problem]],
    rng: random.Random,
) -> dict[str, Any]:  # fmt: skip
    """Supervised pass, then the format pass; saves the model and returns accuracies and sizes."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(PARAMS["seed"])
    torch.set_num_threads(PARAMS["threads"])
    eot, eos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    ids = {"bos_token_id": eot, "eos_token_id": eos, "pad_token_id": eot}
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), tie_word_embeddings=True, **ids, **PARAMS["model"])
    model = Qwen2ForCausalLM(config)
    accuracy: dict[str, Any] = {}
    for name, params in PARAMS["passes"].items():
        train(model, tok, pools, rng, **params)
        accuracy[name] = evaluate(model, tok, test)
        print(f"[tiny-task] after the {name} pass: {accuracy[name]}", flush=True)
    target = PARAMS["format_target"]
    for extra in range(1, target["max_rounds"] + 1):
        pairs = accuracy["format"]["by_terms"]["2"]
        low, high = target["pairs_greedy"]
        if low <= pairs["greedy"] <= high and pairs["greedy_stripped"] >= target["pairs_stripped"]:
            break
        train(model, tok, pools, rng, **{**PARAMS["passes"]["format"], "steps": target["steps"]})
        accuracy["format"] = evaluate(model, tok, test)
        print(f"[tiny-task] after {extra * target['steps']} more format steps: {accuracy['format']}",
              flush=True)
    final = accuracy.pop("format")
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "model.safetensors").chmod(0o644)  # saved through a private temporary file (mode 600)
    n_params = sum(p.numel() for p in model.parameters())
    return {"accuracy": {**accuracy, **final}, "n_params": n_params, "vocab_size": config.vocab_size}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "tokenizers", "pyarrow")}


def remove_stale_builds(out: Path) -> None:
    """Delete temporary directories left on this host by builds that were killed (SIGKILL/SIGTERM)."""
    for stale in out.parent.glob(f".{out.name}.*-{socket.gethostname()}-*"):
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1]), 0)
        except (ProcessLookupError, ValueError):
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:
            pass  # the process is alive (owned by someone else)


def build(out: Path) -> dict[str, Any]:
    """Build into a temporary sibling of `out`, then swap it into place."""
    start = time.time()
    rng = random.Random(PARAMS["seed"])
    test, rl_train, pairs, test_triples = split_problems(rng)
    tag = f"{socket.gethostname()}-{os.getpid()}"
    tmp, old = out.parent / f".{out.name}.tmp-{tag}", out.parent / f".{out.name}.old-{tag}"
    remove_stale_builds(out)
    try:
        write_parquet(tmp / "data" / "train.parquet", rl_train, "train")
        write_parquet(tmp / "data" / "test.parquet", test, "test")
        tok = train_tokenizer(tmp / "model")
        result = build_model(tok, tmp / "model", test, (pairs, test_triples), rng)
        seconds = round(time.time() - start, 1)
        record = {"hash": build_hash(), "params": PARAMS, **result}
        record.update(build_seconds=seconds, versions=versions())
        (tmp / "BUILD.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(), help="output directory")
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is up to date")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not args.force and is_up_to_date(out):
        print(f"[tiny-task] cache is up to date: {out}")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run build()'s cleanup on SIGTERM too
    record = build(out)
    acc = record["accuracy"]
    print(
        f"[tiny-task] built {out} in {record['build_seconds']} s: {record['n_params']} params, "
        f"greedy accuracy {acc['greedy']:.3f}, after stripping leading zeros {acc['greedy_stripped']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
