"""The config reference, generated from the schema in hpcrl.config: commented TOML (`hpcrl config`)
and a Markdown page (`hpcrl config --markdown`, docs/configuration.md). Reads the schema only."""

from __future__ import annotations

import re
import typing
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel

from hpcrl.config import RESUMABLE_CHANGES, Experiment


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"x": value})[4:].strip()


def _fields(model: type[BaseModel], defaults: BaseModel | None):
    """(name, field, default) of a section's own keys, and (name, field) of its nested sections."""
    own, nested = [], []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((name, f))
        else:
            own.append((name, f, getattr(defaults, name) if defaults is not None else f.default))
    return own, nested


def _reference(model: type[BaseModel], section: str, lines: list[str], defaults: BaseModel | None = None) -> None:
    own, nested = _fields(model, defaults)
    lines.append(f"[{section}]")
    for name, f, value in own:
        lines += [f"# {f.description}", f"{name} = {'(required)' if f.is_required() else _toml_value(value)}"]
    lines.append("")
    for name, f in nested:
        lines.append(f"# [{section}.{name}]: {f.description}")
        _reference(f.annotation, f"{section}.{name}", lines, f.default)


def reference() -> str:
    """Every key with its default and description, as commented TOML."""
    lines: list[str] = []
    for section, field in Experiment.model_fields.items():
        _reference(field.annotation, section, lines)
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _inline(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return _toml_value(value)


def _table(model: type[BaseModel], section: str, description: str, defaults: BaseModel | None) -> list[str]:
    """One section (and its nested ones) as a Markdown table of key | default | meaning."""
    out = [f"## [{section}]", ""] + ([_cell(description), ""] if description else [])
    out += ["| key | default | meaning |", "|---|---|---|"]
    own, nested = _fields(model, defaults)
    for name, f, value in own:
        default = "(required)" if f.is_required() else f"`{_inline(value)}`"
        meaning = _cell(f.description or "")
        if typing.get_origin(f.annotation) is Literal:
            meaning += " One of " + ", ".join(f"`{_inline(v)}`" for v in typing.get_args(f.annotation)) + "."
        out.append(f"| `{section}.{name}` | {_cell(default)} | {meaning} |")
    out.append("")
    for name, f in nested:
        out += _table(f.annotation, f"{section}.{name}", f.description or "", f.default)
    return out


def _header(sections: list[str]) -> list[str]:
    resumable = ", ".join(f"`{c}*`" if c.endswith(".") else f"`{c}`" for c in RESUMABLE_CHANGES)
    toc = [f"[{s}](#{re.sub(r'[^a-z0-9_-]', '', s.lower())})" for s in sections]
    return [
        "# Configuration reference", "",
        "<!-- Generated from hpcrl/config.py by `hpcrl config --markdown > docs/configuration.md`; "
        "do not edit by hand. -->", "",
        "An experiment is one TOML file; `configs/demo.toml` is a complete example, and `hpcrl config` "
        "prints every key below as commented TOML. Unknown keys, wrong types, missing files, a dataset "
        "without the prompt column, a tokenizer that does not match the model, a batch that does not "
        "split over the ranks: each is refused before anything runs, naming the file, the key and what "
        "was expected. Relative paths are relative to the config file. `hpcrl submit --set KEY=VALUE` "
        "overrides a key (a TOML value), validated like the file.", "",
        "The resolved config is frozen into the run directory (`experiment.toml`). Resubmitting a changed "
        f"config to an existing run is refused, except for {resumable} (recorded in `run.json`); "
        "`run.iterations` may grow, not shrink.", "",
        "Datasets, reward functions, reward models and reward services are described in "
        "[data-and-rewards.md](data-and-rewards.md), the algorithms behind `[algorithm]` in "
        "[algorithms.md](algorithms.md), `[executor]` in [slurm.md](slurm.md) and [resident.md](resident.md).", "",
        "Sections: " + " · ".join(toc), "",
    ]


def reference_markdown() -> str:
    """The config reference as a Markdown page (docs/configuration.md): a table per section."""
    body: list[str] = []
    for section, field in Experiment.model_fields.items():
        body += _table(field.annotation, section, "", None)
    sections = [line[3:] for line in body if line.startswith("## [")]
    return "\n".join(_header(sections) + body).rstrip() + "\n"
