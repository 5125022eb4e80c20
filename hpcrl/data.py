"""Prompt datasets: reading verl-layout parquet, plain parquet and JSONL into one prompt table.

The normalised table has `data_source` (string), `prompt` (the chat message list as JSON, or
the plain prompt string) and `ground_truth` (string). Rendering to model text and the draw of
each iteration's prompts live here too. No stage logic.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and the column."""


def _read_raw(path: Path) -> pa.Table:
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pq.read_table(path)
        if suffix in (".jsonl", ".json"):
            return pajson.read_json(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{path}: cannot be read as {suffix[1:]}: {err}") from None
    raise DatasetError(f"{path}: unknown dataset format {suffix!r}; expected .parquet or .jsonl")


def _column(table: pa.Table, key: str) -> pa.Array | None:
    """A top-level column, or a struct field for a dotted key (`reward_model.ground_truth`)."""
    head, *rest = key.split(".")
    if head not in table.column_names:
        return None
    col = table.column(head).combine_chunks()
    for part in rest:
        if not pa.types.is_struct(col.type) or col.type.get_field_index(part) < 0:
            return None
        col = pc.struct_field(col, part)
    return col


def _prompt_strings(col: pa.Array, path: Path, key: str) -> list[str]:
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.to_pylist()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        value = col.type.value_type
        if pa.types.is_struct(value) and {"role", "content"} <= {f.name for f in value}:
            return [json.dumps([{"role": m["role"], "content": m["content"]} for m in msgs]) for msgs in col.to_pylist()]
    raise DatasetError(f"{path}: column {key!r} has type {col.type}; expected a string or a chat message list "
                       "(list of {role, content})")


def load_prompts(path: str | Path, prompt_key: str = "prompt",
                 answer_key: str = "reward_model.ground_truth") -> pa.Table:
    """Read a dataset and normalise it to (data_source, prompt, ground_truth)."""
    path = Path(path)
    raw = _read_raw(path)
    prompt = _column(raw, prompt_key)
    if prompt is None:
        raise DatasetError(f"{path}: no prompt column {prompt_key!r} (columns: {raw.column_names}); "
                           "set data.prompt_key")
    answer = _column(raw, answer_key)
    if answer is None:
        answer = _column(raw, "answer")
    if answer is None:
        raise DatasetError(f"{path}: no answer column {answer_key!r} nor 'answer' (columns: {raw.column_names}); "
                           "set data.answer_key")
    source = _column(raw, "data_source")
    n = raw.num_rows
    if n == 0:
        raise DatasetError(f"{path}: the dataset has no rows")
    return pa.table({
        "data_source": source.cast(pa.string()) if source is not None else pa.array([path.stem] * n),
        "prompt": pa.array(_prompt_strings(prompt, path, prompt_key), pa.string()),
        "ground_truth": answer.cast(pa.string()),
    })


def render(tokenizer, prompt: str) -> str:
    """Model input text: chat messages through the tokenizer's chat template, strings as they are."""
    if prompt.startswith("[{"):
        try:
            messages = json.loads(prompt)
        except json.JSONDecodeError:
            return prompt
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt


def draw_prompts(n_rows: int, per_iteration: int, iteration: int, seed: int) -> np.ndarray:
    """Row indices for an iteration: consecutive slices of seeded per-epoch permutations.

    A slice that crosses an epoch boundary skips rows it already holds, so an iteration never
    draws a prompt twice (its GRPO groups stay distinct).
    """
    if per_iteration > n_rows:
        raise ValueError(f"{per_iteration} prompts per iteration but the dataset has only {n_rows} rows")
    position = iteration * per_iteration
    out: list[int] = []
    seen: set[int] = set()
    perms: dict[int, np.ndarray] = {}
    while len(out) < per_iteration:
        epoch, offset = divmod(position, n_rows)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n_rows)
        row = int(perms[epoch][offset])
        position += 1
        if row not in seen:
            seen.add(row)
            out.append(row)
    return np.asarray(out, dtype=np.int64)
