#!/usr/bin/env python
"""Turn the GSM8K parquet files of HF `openai/gsm8k` (config `main`) into verl's layout.

Usage:
    python tools/prepare_gsm8k.py --train RAW/main/train-00000-of-00001.parquet \
        --test RAW/main/test-00000-of-00001.parquet --out data/gsm8k

The raw files have the columns `question` and `answer` (worked solution ending in "#### N").
Each row becomes what verl's examples/data_preprocess/gsm8k.py writes, so the GSM8K recipes in
configs/ (and verl itself) read it as is:

    data_source  "openai/gsm8k"
    prompt       [{role: "user", content: question + " " + INSTRUCTION}]
    ability      "math"
    reward_model {style: "rule", ground_truth: N}      N without thousands separators
    extra_info   {split, index, answer, question}

OUT receives train.parquet and test.parquet, each written to a temporary name and renamed into
place. Reads and writes with pyarrow only; no network.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


class PrepareError(ValueError):
    """A raw file that is not GSM8K-shaped; the message names the file and the row."""


def final_answer(solution: str) -> str | None:
    """The number after "####", without thousands separators ("1,000" -> "1000")."""
    match = FINAL_ANSWER.search(solution)
    return match.group(1).replace(",", "") if match else None


def convert(raw: pa.Table, split: str, source: str = "") -> pa.Table:
    """verl-layout rows of one split of raw GSM8K (`question`, `answer`)."""
    missing = {"question", "answer"} - set(raw.column_names)
    if missing:
        raise PrepareError(f"{source}: no column(s) {sorted(missing)} (columns: {raw.column_names}); "
                           "expected the openai/gsm8k `main` parquet")
    questions, answers = raw["question"].to_pylist(), raw["answer"].to_pylist()
    truths = []
    for i, answer in enumerate(answers):
        truth = final_answer(answer or "")
        if truth is None:
            raise PrepareError(f"{source}: row {i}: the answer has no '#### <number>' line: {answer!r}")
        truths.append(truth)
    n = raw.num_rows
    return pa.table({
        "data_source": [DATA_SOURCE] * n,
        "prompt": [[{"role": "user", "content": f"{q} {INSTRUCTION}"}] for q in questions],
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
        "extra_info": [{"split": split, "index": i, "answer": a, "question": q}
                       for i, (q, a) in enumerate(zip(questions, answers, strict=True))],
    })


def prepare(train: Path, test: Path, out: Path) -> list[Path]:
    """Write OUT/train.parquet and OUT/test.parquet; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for split, raw_path in (("train", train), ("test", test)):
        if not raw_path.is_file():
            raise PrepareError(f"{raw_path}: file not found")
        table = convert(pq.read_table(raw_path), split, str(raw_path))
        dest = out / f"{split}.parquet"
        tmp = dest.with_name(f".{dest.name}.tmp")
        pq.write_table(table, tmp)
        tmp.replace(dest)
        written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=Path, required=True, help="raw openai/gsm8k main train parquet")
    parser.add_argument("--test", type=Path, required=True, help="raw openai/gsm8k main test parquet")
    parser.add_argument("--out", type=Path, default=Path("data/gsm8k"), help="output directory [data/gsm8k]")
    args = parser.parse_args(argv)
    try:
        paths = prepare(args.train, args.test, args.out)
    except (PrepareError, pa.ArrowInvalid, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}: {pq.read_metadata(path).num_rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
