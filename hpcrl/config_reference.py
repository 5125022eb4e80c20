"""The config reference, generated from the schema in hpcrl.config: commented TOML (`hpcrl config`)
and a Markdown page (`hpcrl config --markdown`, docs/configuration.md). Reads the schema only."""

from __future__ import annotations

import re
import typing
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel

from hpcrl.config import RESUMABLE_CHANGES, Experiment, sections_of


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"x": value})[4:].strip()


def _choices(models: list[type[BaseModel]], name: str) -> list:
    """The values a Literal key takes in any of the section's variants (the executor's modes)."""
    annotations = [m.model_fields[name].annotation for m in models if name in m.model_fields]
    return [v for a in annotations if typing.get_origin(a) is Literal for v in typing.get_args(a)]


def _fields(models: list[type[BaseModel]], defaults: BaseModel | None):
    """(name, field, default, choices) of a section's own keys, and (name, field) of its nested
    sections; a section that is a union of variants has the keys of all, the first's defaults."""
    own, nested, seen = [], [], set()
    for model in models:
        for name, f in model.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            if sections_of(f.annotation):
                nested.append((name, f))
            else:
                value = getattr(defaults, name) if defaults is not None else f.default
                own.append((name, f, value, _choices(models, name)))
    return own, nested


def _reference(models: list[type[BaseModel]], section: str, lines: list[str],
               defaults: BaseModel | None = None) -> None:
    own, nested = _fields(models, defaults)
    lines.append(f"[{section}]")
    for name, f, value, _ in own:
        lines += [f"# {f.description}", f"{name} = {'(required)' if f.is_required() else _toml_value(value)}"]
    lines.append("")
    for name, f in nested:
        lines.append(f"# [{section}.{name}]: {f.description}")
        _reference(sections_of(f.annotation), f"{section}.{name}", lines, f.default)


def reference() -> str:
    """Every key with its default and description, as commented TOML."""
    lines: list[str] = []
    for section, field in Experiment.model_fields.items():
        _reference(sections_of(field.annotation), section, lines)
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _inline(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return _toml_value(value)


def _table(models: list[type[BaseModel]], section: str, description: str,
           defaults: BaseModel | None) -> list[str]:
    """One section (and its nested ones) as a Markdown table of key | default | meaning."""
    out = [f"## [{section}]", ""] + ([_cell(description), ""] if description else [])
    out += ["| key | default | meaning |", "|---|---|---|"]
    own, nested = _fields(models, defaults)
    for name, f, value, choices in own:
        default = "(required)" if f.is_required() else f"`{_inline(value)}`"
        meaning = _cell(f.description or "")
        if choices:
            meaning += " One of " + ", ".join(f"`{_inline(v)}`" for v in dict.fromkeys(choices)) + "."
        out.append(f"| `{section}.{name}` | {_cell(default)} | {meaning} |")
    out.append("")
    for name, f in nested:
        out += _table(sections_of(f.annotation), f"{section}.{name}", f.description or "", f.default)
    return out


def _header(sections: list[str]) -> list[str]:
    resumable = ", ".join(f"`{c}*`" if c.endswith(".") else f"`{c}`" for c in RESUMABLE_CHANGES)
    toc = [f"[{s}](#{re.sub(r'[^a-z0-9_-]', '', s.lower())})" for s in sections]
    return [
        "# Configuration reference", "",
        "<!-- Generated from hpcrl/config.py by `hpcrl config --markdown > docs/configuration.md`; "
        "do not edit by hand. -->", "",
        "An experiment is one TOML file; `configs/demo.toml` is a complete example, and `hpcrl config` "
        "prints every key below as commented TOML. Unknown keys, wrong types, numbers that are not "
        "finite, missing files, a dataset without the prompt column or with null prompts, a model "
        "directory whose weights are missing, truncated or do not match their index, a tokenizer that "
        "does not match the model, `model.max_model_len` beyond the model's positions, a batch that does "
        "not split over the ranks: each is refused before anything runs, naming the file, the key and "
        "what was expected. Relative paths are relative to the config file. `hpcrl submit --set KEY=VALUE` "
        "overrides a key (a TOML value), validated like the file.", "",
        "The resolved config is frozen into the run directory (`experiment.toml`). Resubmitting a changed "
        f"config to an existing run is refused, except for {resumable} (recorded in `run.json`); "
        "`run.iterations` may grow, not shrink.", "",
        "Datasets, reward functions, reward models and reward services are described in "
        "[data-and-rewards.md](data-and-rewards.md), the algorithms behind `[algorithm]` in "
        "[algorithms.md](algorithms.md), `[executor]` in [slurm.md](slurm.md) and "
        "[resident.md](resident.md).", "",
        "Sections: " + " · ".join(toc), "",
    ]


def reference_markdown() -> str:
    """The config reference as a Markdown page (docs/configuration.md): a table per section."""
    body: list[str] = []
    for section, field in Experiment.model_fields.items():
        body += _table(sections_of(field.annotation), section, "", None)
    sections = [line[3:] for line in body if line.startswith("## [")]
    return "\n".join(_header(sections) + body).rstrip() + "\n"
