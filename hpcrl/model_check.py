"""Checks of a Hugging Face model directory before any job starts: its config.json, its weight
files (present, complete, and matching their index), and the limits the experiment puts on it
(`model.max_model_len` within the model's positions, a tokenizer that fits the embedding).

Weight files are checked by their safetensors headers only (names, shapes, the byte ranges the
file must cover), so a 70B model is checked in milliseconds without reading its tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TORCH_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def read_config(directory: str, key: str) -> tuple[list[str], dict | None]:
    """(problems, config.json as a dict) of the model directory named by `key`."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return [f"{key}: {directory}: not an HF model directory (no config.json)"], None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return [f"{key}: {path}: not valid JSON ({err})"], None
    if not isinstance(cfg, dict):
        return [f"{key}: {path}: expected a JSON object of model settings, got a {type(cfg).__name__}"], None
    return [], cfg


def _header(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors header; raises ValueError saying what is wrong."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "np") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a complete safetensors file ({err}); copy it again") from err


def _indexed_shapes(directory: Path, key: str) -> tuple[list[str], dict[str, list[int]]]:
    index_path = directory / INDEX
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        names_by_shard: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            names_by_shard.setdefault(shard, set()).add(name)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        return [f"{key}: {index_path}: not a safetensors index (expected JSON with a weight_map): {err}"], {}
    problems: list[str] = []
    shapes: dict[str, list[int]] = {}
    for shard, names in sorted(names_by_shard.items()):
        if not (directory / shard).is_file():
            problems.append(f"{key}: {index_path} names {shard}, which is missing")
            continue
        try:
            header = _header(directory / shard)
        except ValueError as err:
            problems.append(f"{key}: {err}")
            continue
        absent = sorted(names - header.keys())
        if absent:
            problems.append(f"{key}: {directory / shard} lacks {len(absent)} tensors its index places there "
                            f"(first: {absent[0]})")
        shapes.update(header)
    return problems, shapes


def weight_shapes(directory: str, key: str) -> tuple[list[str], dict[str, list[int]]]:
    """(problems, tensor name -> shape) of the model's weights: a safetensors index and all its
    shards, or one model.safetensors. PyTorch .bin weights are accepted unchecked (no shapes)."""
    d = Path(directory)
    if (d / INDEX).is_file():
        return _indexed_shapes(d, key)
    if (d / SINGLE).is_file():
        try:
            return [], _header(d / SINGLE)
        except ValueError as err:
            return [f"{key}: {err}"], {}
    if any((d / name).is_file() for name in TORCH_FILES):
        return [], {}
    return [f"{key}: {directory}: no weights (expected {SINGLE}, {INDEX} and its shards, or "
            f"{TORCH_FILES[0]})"], {}


def _text_setting(cfg: dict, name: str):
    return cfg.get(name) if cfg.get(name) is not None else (cfg.get("text_config") or {}).get(name)


def limit_problems(cfg: dict, shapes: dict[str, list[int]], max_model_len: int, path: str) -> list[str]:
    """model.max_model_len against the model's positions; config.json's vocab_size against the
    embedding the weights hold."""
    problems = []
    positions = _text_setting(cfg, "max_position_embeddings")
    if isinstance(positions, int) and max_model_len > positions:
        problems.append(f"model.max_model_len: {max_model_len} is more than the model's "
                        f"max_position_embeddings = {positions} ({path}/config.json); expected at most "
                        f"{positions}")
    vocab = _text_setting(cfg, "vocab_size")
    rows = [shape[0] for name, shape in shapes.items() if name.endswith("embed_tokens.weight") and shape]
    if isinstance(vocab, int) and rows and rows[0] != vocab:
        problems.append(f"model.path: {path}: config.json says vocab_size = {vocab} but the weights' "
                        f"embedding has {rows[0]} rows: the config and the weights do not belong together")
    return problems


def linear_problems(names: list[str], shapes: dict[str, list[int]], cfg: dict, path: str,
                    key: str) -> list[str]:
    """Each of `names` the last name of some linear layer of the model's blocks (a 2-D
    `<...>.<name>.weight` that is not the vocabulary's: the embedding and the head are not
    adapted)."""
    vocab = _text_setting(cfg, "vocab_size")
    linear = {n.split(".")[-2] for n, shape in shapes.items()
              if n.endswith(".weight") and len(shape) == 2 and n.count(".") >= 1 and vocab not in shape}
    missing = [name for name in names if name not in linear]
    if not missing:
        return []
    return [f"{key}: {missing} name no linear layer of {path}; expected some of {sorted(linear)}"]
