"""The documentation: docs/configuration.md is generated from the config schema, and links resolve."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_configuration_md_is_generated_from_the_schema():
    """pins: docs/configuration.md is, byte for byte, the reference the schema generates (its header,
    tables, defaults, choices and escaping). The generator is called here, in the test's process, so
    that mutation testing runs this test against config_reference's mutants."""
    from hpcrl import config_reference

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config_reference.reference_markdown(), (
        "docs/configuration.md is stale; regenerate it: "
        ".venv/bin/hpcrl config --markdown > docs/configuration.md")


def test_hpcrl_config_markdown_prints_configuration_md():
    """pins: the command that regenerates the page prints it."""
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "config", "--markdown"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert (REPO / "docs" / "configuration.md").read_text() == out.stdout, (
        "docs/configuration.md is stale; regenerate it: "
        ".venv/bin/hpcrl config --markdown > docs/configuration.md")


def _unescape(cell: str) -> str:
    return cell.strip().replace("\\|", "|").replace("&lt;", "<")


def _markdown_keys(page: str) -> tuple[list[tuple[str, object, str]], dict[str, str]]:
    """(dotted key, default, meaning) of each table row of the page, and each section's description."""
    rows, sections, section, lines = [], {}, "", page.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## ["):
            section = line[4:-1]
            text = lines[i + 2]
            sections[section] = "" if text.startswith("| key |") else _unescape(text)
        elif line.startswith("| `"):
            key, default, meaning = (_unescape(c) for c in re.split(r"(?<!\\)\|", line)[1:4])
            value = "(required)" if default == "(required)" else tomllib.loads(f"v = {default[1:-1]}")["v"]
            rows.append((key.strip("`"), value, meaning))
    return rows, sections


def _toml_keys(text: str) -> tuple[list[tuple[str, object, str]], dict[str, str]]:
    """(dotted key, default, comment above it) of each key of the commented TOML reference, and the
    description of each nested section (its "# [section]: ..." line)."""
    keys, sections, lines = [], {}, text.splitlines()
    blocks = re.split(r"^\[([\w.]+)\]$", text, flags=re.M)
    values = {section: tomllib.loads(body.replace(" = (required)", ' = "(required)"'))
              for section, body in zip(blocks[1::2], blocks[2::2], strict=True)}
    section = ""
    for i, line in enumerate(lines):
        if m := re.fullmatch(r"\[([\w.]+)\]", line):
            section = m[1]
        elif m := re.fullmatch(r"# \[([\w.]+)\]: (.*)", line):
            sections[m[1]] = m[2]
        elif m := re.match(r"(\w+) = ", line):
            assert lines[i - 1].startswith("# "), line
            keys.append((f"{section}.{m[1]}", values[section][m[1]], lines[i - 1][2:]))
    return keys, sections


def test_the_toml_reference_lists_every_key_with_the_pages_default_and_meaning():
    """pins: `hpcrl config` (commented TOML) has docs/configuration.md's keys in its order, each under
    its section, with the same default (required keys written `(required)`, a valid TOML value
    otherwise: the values of a section read back as TOML) and the page's meaning as the comment
    above it (the page adds the choices of a key with fixed values); each nested section is
    introduced with the page's description of it."""
    from hpcrl import config_reference

    page_keys, page_sections = _markdown_keys((REPO / "docs" / "configuration.md").read_text())
    toml_keys, toml_sections = _toml_keys(config_reference.reference())
    assert [k for k, _, _ in toml_keys] == [k for k, _, _ in page_keys]
    for (key, value, comment), (_, default, meaning) in zip(toml_keys, page_keys, strict=True):
        assert value == default, key
        assert meaning == comment or meaning.startswith(f"{comment} One of "), key
    assert toml_sections == {s: d for s, d in page_sections.items() if "." in s}
    assert ("executor.controller.cpus_per_task", 1, "CPUs per task.") in toml_keys  # not the class's 2


def test_reference_values_are_toml_that_reads_back():
    """pins: the reference's inline values (config_reference._toml_value, _inline) for every kind a
    default may take, tables and lists of several entries included; and a table cell escapes `|`
    and `<`."""
    from hpcrl.config_reference import _cell, _inline, _toml_value

    values = [{"exclude": "n3", "exclusive": True, "nested": {"a": 1, "b": "c"}}, {}, ["a", "b"], ("x", 2),
              [], 1e-05, 0.0, 3, True, "a \"b\""]
    for value in values:
        text = _inline(value)
        assert "\n" not in text
        back = tomllib.loads(f"v = {text}")["v"]
        assert back == (list(value) if isinstance(value, tuple) else value), text
    assert _toml_value({"a": 1, "b": "x"}) == '{a = 1, b = "x"}' and _inline(["a", "b"]) == '["a", "b"]'
    assert tomllib.loads(f"v = {_toml_value(['a', 'b'])}")["v"] == ["a", "b"]
    assert _cell("a | b <c>") == "a \\| b &lt;c>"


def test_an_undocumented_key_or_section_gets_an_empty_meaning():
    """pins: a key without a description has an empty meaning cell, and a nested section without one
    no description paragraph (no placeholder text in the page)."""
    from pydantic import BaseModel

    from hpcrl.config_reference import _table

    class Inner(BaseModel):
        k: int = 1

    class Outer(BaseModel):
        inner: Inner = Inner()

    assert _table([Outer], "s", "", None) == [
        "## [s]", "", "| key | default | meaning |", "|---|---|---|", "",
        "## [s.inner]", "", "| key | default | meaning |", "|---|---|---|", "| `s.inner.k` | `1` |  |", ""]


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links if not re.match(r"[a-z]+:|#", link)]


def test_relative_links_in_readme_and_docs_point_at_files():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(REPO)}: {link}" for page in pages
              for link in _relative_links(page.read_text()) if not (page.parent / link).exists()]
    assert not broken, f"links to missing files: {broken}"
