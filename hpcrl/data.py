"""Prompt datasets: reading verl-layout parquet, plain parquet, JSONL and HF `datasets` directories
into one prompt table, the length filter, rendering, and the draw of each iteration's prompts.

The normalised table has `data_source` (string), `prompt` (the chat message list as JSON, or
the plain prompt string) and `ground_truth` (string). `prompt_set` is what preflight and the
generate stage both call, so they see the same filtered rows. No stage logic.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq

from hpcrl import commit, hf_imports

if TYPE_CHECKING:
    from hpcrl.config import Experiment

WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx"}
TOKENIZE_BATCH = 1024


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and the column."""


def _hf_split_dir(path: Path, split: str) -> Path:
    """The directory of one `datasets.Dataset` written by `save_to_disk` (a DatasetDict's split)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DatasetError(f"{path}: a datasets DatasetDict with the splits {splits}, none named "
                               f"{split!r}; choose one with data.train_split / data.test_split")
        path = path / split
    if not (path / "state.json").is_file():
        raise DatasetError(f"{path}: a directory, but not one written by datasets' save_to_disk "
                           "(no state.json nor dataset_dict.json)")
    return path


def _read_hf(path: Path) -> pa.Table:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path}: reading a datasets directory needs the `datasets` package") from None
    try:
        return datasets.load_from_disk(str(path)).with_format("arrow")[:]
    except (OSError, ValueError, pa.ArrowInvalid) as err:
        raise DatasetError(f"{path}: cannot be read with datasets.load_from_disk: {err}") from None


def _read_raw(path: Path, split: str) -> pa.Table:
    if path.is_dir():
        return _read_hf(_hf_split_dir(path, split))
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            table = commit.read_parquet(path)
        elif suffix in (".jsonl", ".json"):
            table = pajson.read_json(path)
        else:
            table = None
        if table is not None:
            table.validate(full=True)  # text that is not UTF-8 is found here, not when a prompt is read
            return table
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{path}: cannot be read as {suffix[1:]}: {err}") from None
    raise DatasetError(f"{path}: unknown dataset format {suffix!r}; expected .parquet, .jsonl or a datasets "
                       "save_to_disk directory")


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


def _chat_json(msgs: list[dict] | None, i: int, path: Path, key: str) -> str:
    if msgs is None:
        raise DatasetError(f"{path}: column {key!r}: prompt {i} is null; expected a list of chat messages")
    for j, m in enumerate(msgs):
        if m is None or m["role"] is None or m["content"] is None:
            raise DatasetError(f"{path}: column {key!r}: prompt {i}: message {j} has no content or role; "
                               "expected {role, content} strings")
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in msgs])


def _prompt_strings(col: pa.Array, path: Path, key: str) -> list[str]:
    if col.null_count and not pa.types.is_list(col.type) and not pa.types.is_large_list(col.type):
        first = col.is_null().to_pylist().index(True)
        raise DatasetError(f"{path}: column {key!r}: prompt {first} is null ({col.null_count} null prompts); "
                           "expected a prompt in every row")
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.to_pylist()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        value = col.type.value_type
        if pa.types.is_struct(value) and {"role", "content"} <= {f.name for f in value}:
            return [_chat_json(msgs, i, path, key) for i, msgs in enumerate(col.to_pylist())]
    raise DatasetError(f"{path}: column {key!r} has type {col.type}; expected a string or a chat message "
                       "list (list of {role, content})")


def load_prompts(path: str | Path, prompt_key: str = "prompt",
                 answer_key: str = "reward_model.ground_truth", split: str = "train") -> pa.Table:
    """Read a dataset and normalise it to (data_source, prompt, ground_truth), every row.

    `split` names the split when `path` is a `DatasetDict.save_to_disk` directory.
    """
    path = Path(path)
    raw = _read_raw(path, split)
    prompt = _column(raw, prompt_key)
    if prompt is None:
        raise DatasetError(f"{path}: no prompt column {prompt_key!r} (columns: {raw.column_names}); "
                           "set data.prompt_key")
    answer = _column(raw, answer_key)
    if answer is None:
        answer = _column(raw, "answer")
    if answer is None:
        raise DatasetError(f"{path}: no answer column {answer_key!r} nor 'answer' "
                           f"(columns: {raw.column_names}); set data.answer_key")
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


# ---- the length filter ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptSet:
    """A split's prompts after the length filter: `table` is what iterations draw from."""

    table: pa.Table
    total: int  # rows in the dataset
    too_long: int  # prompts longer than `limit` tokens; dropped from `table` when data.filter_overlong
    limit: int  # model.max_model_len - generate.max_tokens


def _digest(files: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update((f.relative_to(root).as_posix() if root.is_dir() else "").encode() + b"\0")
        with f.open("rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


def _sources(exp: Experiment, path: Path, split: str) -> tuple[Path, list[Path], Path, list[Path]]:
    """(data root, its files, tokenizer directory, its files but the weights): what a split's
    prompt set is made of."""
    source = _hf_split_dir(path, split) if path.is_dir() else path
    data_files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    tok_dir = Path(exp.tokenizer_path)
    return source, data_files, tok_dir, _tokenizer_files(tok_dir)


def _tokenizer_files(tok_dir: Path) -> list[Path]:
    return sorted(p for p in tok_dir.iterdir() if p.is_file() and p.suffix not in WEIGHT_SUFFIXES)


def _lengths_file(exp: Experiment, path: Path, split: str) -> Path:
    """Cache file of a dataset's prompt lengths, named by the bytes of the data and the tokenizer."""
    source, data_files, tok_dir, tok_files = _sources(exp, path, split)
    key = json.dumps({"v": 1, "data": _digest(data_files, source), "prompt_key": exp.data.prompt_key,
                      "tokenizer": _digest(tok_files, tok_dir)})
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return cache_dir(exp) / "prompt-lengths" / f"{name}.parquet"


def _measure(prompts: list[str], tokenizer, path: Path) -> np.ndarray:
    """Tokens of each rendered prompt, counted as the engine will see it."""
    if not tokenizer.chat_template and any(p.startswith("[{") for p in prompts):
        raise DatasetError(f"{path}: prompts are chat messages but the tokenizer has no chat template")
    out: list[int] = []
    for i in range(0, len(prompts), TOKENIZE_BATCH):
        texts = [render(tokenizer, p) for p in prompts[i: i + TOKENIZE_BATCH]]
        out += [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return np.asarray(out, dtype=np.int32)


def prompt_lengths(exp: Experiment, split: str, table: pa.Table, tokenizer=None) -> np.ndarray:
    """Tokens of every prompt of a split, cached under <cache>/prompt-lengths/ (`cache_dir`).

    The cache is keyed by the dataset's and the tokenizer's bytes, so a run and its stages reuse
    one measurement; the tokenizer (exp.tokenizer_path unless given) is loaded only on a miss.
    """
    path = Path(getattr(exp.data, split))
    cache = _lengths_file(exp, path, getattr(exp.data, f"{split}_split"))
    if cache.is_file():
        lengths = commit.read_parquet(cache)["prompt_tokens"].to_numpy()
        if len(lengths) == table.num_rows:
            return lengths
    lengths = _measure(table["prompt"].to_pylist(), tokenizer or load_tokenizer(exp), path)
    _cache_write(cache, lambda tmp: pq.write_table(pa.table({"prompt_tokens": lengths}), tmp))
    return lengths


def load_tokenizer(exp: Experiment):
    hf_imports.skip_scikit_learn()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(exp.tokenizer_path)


@dataclass(frozen=True)
class TokenizerFacts:
    """What the pre-flight checks of a tokenizer: its tokens (added ones too) and its eos token."""

    tokens: int
    eos_token_id: int | None


def tokenizer_facts(exp: Experiment) -> tuple[TokenizerFacts, object | None]:
    """(facts, the tokenizer loaded for them or None): cached under <cache>/tokenizers/ by the
    tokenizer's bytes, so a submit that finds them does not import transformers (5 s). Raises what
    loading the tokenizer raises."""
    tok_dir = Path(exp.tokenizer_path)
    cache = cache_dir(exp) / "tokenizers" / f"{_digest(_tokenizer_files(tok_dir), tok_dir)[:32]}.json"
    try:
        return TokenizerFacts(**json.loads(cache.read_text())), None
    except (OSError, ValueError, TypeError):
        pass
    tokenizer = load_tokenizer(exp)
    facts = TokenizerFacts(len(tokenizer), tokenizer.eos_token_id)
    _cache_write(cache, lambda tmp: tmp.write_text(json.dumps(asdict(facts))))
    return facts, tokenizer


def cache_dir(exp: Experiment) -> Path:
    """Where measurements of datasets and tokenizers are kept: $HPCRL_CACHE_DIR, or
    <runs_root>/.cache. Entries are named by the bytes they were measured from, never edited."""
    return Path(os.environ.get("HPCRL_CACHE_DIR") or Path(exp.run.runs_root) / ".cache")


def _cache_write(path: Path, write) -> None:
    """write(tmp), then tmp renamed to `path`. A cache: a directory that cannot hold it (preflight
    names a runs_root it cannot write) only costs a new measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write(tmp)
        tmp.replace(path)
    except OSError:
        pass


def prompt_set(exp: Experiment, split: str, tokenizer=None) -> PromptSet:
    """The prompts of `split` ("train" or "test") that iterations use.

    Prompts longer than model.max_model_len - generate.max_tokens tokens are counted, and dropped
    when data.filter_overlong (preflight refuses the run otherwise). Deterministic: the same
    dataset and tokenizer give the same rows, in dataset order.
    """
    d = exp.data
    limit = exp.model.max_model_len - exp.generate.max_tokens
    _, data_files, _, tok_files = _sources(exp, Path(getattr(d, split)), getattr(d, f"{split}_split"))
    key = (split, getattr(d, split), getattr(d, f"{split}_split"), d.prompt_key, d.answer_key, limit,
           d.filter_overlong, exp.tokenizer_path, _stamps(data_files + tok_files))
    if key in _PROMPT_SETS:  # a resident generator draws from the same set every iteration
        return _PROMPT_SETS[key]
    table = load_prompts(getattr(d, split), d.prompt_key, d.answer_key, getattr(d, f"{split}_split"))
    keep = prompt_lengths(exp, split, table, tokenizer) <= limit
    too_long = int((~keep).sum())
    total = table.num_rows
    if d.filter_overlong and too_long:
        table = table.filter(pa.array(keep))
    if len(_PROMPT_SETS) >= 8:
        _PROMPT_SETS.clear()
    _PROMPT_SETS[key] = PromptSet(table, total, too_long, limit)
    return _PROMPT_SETS[key]


_PROMPT_SETS: dict[tuple, PromptSet] = {}  # this process's sets, keyed by their files' stamps and settings


def _stamps(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime) of each file: a file rewritten since reads again; (path, -1, -1) for a
    missing one (reading it then says which)."""
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            out.append((str(f), -1, -1))
        else:
            out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(out)


def draw_prompts(n_rows: int, per_iteration: int, iteration: int, seed: int,
                 sampling_round: int = 0) -> np.ndarray:
    """Row indices for an iteration: consecutive slices of seeded per-epoch permutations.

    A slice that crosses an epoch boundary skips rows it already holds, so an iteration never
    draws a prompt twice (its GRPO groups stay distinct).

    `sampling_round` r >= 1 (dynamic sampling) draws up to `per_iteration` more rows: slice r - 1
    of a permutation seeded by (seed, iteration) of the rows that round 0 did not draw. Rounds
    of one iteration never repeat a row; a round finds fewer (or no) rows once the dataset is
    used up. Round 0 is the same with or without dynamic sampling, and no round moves the draws
    of later iterations.
    """
    if per_iteration > n_rows:
        raise ValueError(f"{per_iteration} prompts per iteration but the dataset has only {n_rows} rows")
    if sampling_round < 0:
        raise ValueError(f"sampling round {sampling_round}: expected 0 or more")
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
    first = np.asarray(out, dtype=np.int64)
    if sampling_round == 0:
        return first
    # A three-word key with a non-zero last word: never the key of an epoch permutation above
    # (numpy's SeedSequence reads [seed, epoch] as [seed, epoch, 0]).
    rest = np.random.default_rng([seed, iteration, 1]).permutation(n_rows)
    rest = rest[~np.isin(rest, first)]
    start = (sampling_round - 1) * per_iteration
    return rest[start: start + per_iteration].astype(np.int64)
