"""Rewrite an experiment file that uses keys which moved into sections (hpcrl.config.MOVED):
`algorithm.kl_*` into [algorithm.kl], the critic's keys into [algorithm.critic], the resident-only
executor keys into [executor.resident]. Comments and the order of the other keys are kept.

    python tools/migrate_config.py old.toml            # the new file on stdout
    python tools/migrate_config.py --in-place a.toml b.toml
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hpcrl.config import MOVED

HEADER = re.compile(r"^\s*\[([A-Za-z0-9_.]+)\]")
KEY = re.compile(r"^\s*([A-Za-z0-9_]+)\s*=")


def migrate(text: str) -> str:
    """The file with every moved key under its new section (appended after its old section)."""
    out: list[str] = []
    moved: dict[str, dict[str, list[str]]] = {}  # old section -> new section -> lines
    section = ""
    for line in text.splitlines():
        if (header := HEADER.match(line)) is not None:
            section = header.group(1)
        elif (key := KEY.match(line)) is not None and f"{section}.{key.group(1)}" in MOVED:
            new = MOVED[f"{section}.{key.group(1)}"].split(" ")[0]
            new_section, new_key = new.rsplit(".", 1)
            line = line.replace(key.group(1), new_key, 1)
            moved.setdefault(section, {}).setdefault(new_section, []).append(line)
            continue
        out.append(line)
    for old, news in moved.items():
        at = _end_of_section(out, old)
        block = [part for new, lines in news.items() for part in ("", f"[{new}]", *lines)]
        out[at:at] = block
    return "\n".join(out) + "\n"


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
        new = migrate(path.read_text())
        if args.in_place:
            path.write_text(new)
        else:
            sys.stdout.write(new)


if __name__ == "__main__":
    main()
