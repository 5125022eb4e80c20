"""Rewrite an experiment file that uses keys which moved into sections (hpcrl.config.MOVED):
`algorithm.kl_*` into [algorithm.kl], the critic's keys into [algorithm.critic], the resident-only
executor keys into [executor.resident]. Comments and the order of the other keys are kept; a key
joins its section where the file already has it. Keys a section may not hold in this file are
dropped, each named on stderr: the critic's unless algorithm.name = "ppo", [executor.resident]
unless executor.mode = "resident" (a frozen config of an older run lists them all).

    python tools/migrate_config.py old.toml            # the new file on stdout
    python tools/migrate_config.py --in-place a.toml b.toml
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

from hpcrl.config import MOVED

HEADER = re.compile(r"^\s*\[([A-Za-z0-9_.]+)\]")
KEY = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=")


def _allowed(text: str) -> dict[str, bool]:
    """Whether the file may hold each optional section."""
    data = tomllib.loads(text)
    return {"algorithm.critic": data.get("algorithm", {}).get("name") == "ppo",
            "executor.resident": data.get("executor", {}).get("mode") == "resident"}


def migrate(text: str, dropped: list[str] | None = None) -> str:
    """The file with every moved key in its new section; `dropped` collects what was left out."""
    allowed, dropped = _allowed(text), dropped if dropped is not None else []
    out: list[str] = []
    moved: dict[str, list[str]] = {}  # new section -> its lines
    section = ""
    for line in text.splitlines():
        if (header := HEADER.match(line)) is not None:
            section = header.group(1)
        skip = any(section == k or section.startswith(k + ".") for k, ok in allowed.items() if not ok)
        if (key := KEY.match(line)) is not None and f"{section}.{key.group(1)}" in MOVED:
            new_section, new_key = MOVED[f"{section}.{key.group(1)}"].split(" ")[0].rsplit(".", 1)
            if allowed.get(new_section, True):
                moved.setdefault(new_section, []).append(line.replace(key.group(1), new_key, 1))
            else:
                dropped.append(f"{section}.{key.group(1)}")
            continue
        if skip:
            if key is not None:
                dropped.append(f"{section}.{key.group(1)}")
            continue
        out.append(line)
    for new, lines in moved.items():
        _insert(out, new, lines)
    return "\n".join(out) + "\n"


def _insert(lines: list[str], section: str, keys: list[str]) -> None:
    """Add `keys` at the end of [section], or as a new [section] after its parent's keys."""
    parent = section.rsplit(".", 1)[0]
    if any((h := HEADER.match(line)) and h.group(1) == section for line in lines):
        at = _end_of_section(lines, section)
        lines[at:at] = keys
    else:
        at = _end_of_section(lines, parent)
        lines[at:at] = ["", f"[{section}]", *keys]


def _end_of_section(lines: list[str], section: str) -> int:
    """Where the keys of [section] end (before the blank lines preceding the next header)."""
    start = next(i for i, line in enumerate(lines) if (h := HEADER.match(line)) and h.group(1) == section)
    end = next((i for i in range(start + 1, len(lines)) if HEADER.match(lines[i])), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return end


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--in-place", action="store_true", help="rewrite the files instead of printing")
    args = parser.parse_args(argv)
    for path in args.files:
        dropped: list[str] = []
        new = migrate(path.read_text(), dropped)
        if dropped:
            print(f"{path}: left out (not allowed in this config): {', '.join(dropped)}", file=sys.stderr)
        if args.in_place:
            path.write_text(new)
        else:
            sys.stdout.write(new)


if __name__ == "__main__":
    main()
