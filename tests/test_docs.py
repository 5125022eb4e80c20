"""The documentation: docs/configuration.md is generated from the config schema, and links resolve."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_configuration_md_is_generated_from_the_schema():
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "config", "--markdown"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == out.stdout, (
        "docs/configuration.md is stale; regenerate it: "
        ".venv/bin/hpcrl config --markdown > docs/configuration.md")


def test_markdown_reference_has_every_key_of_the_toml_reference():
    from hpcrl import config_reference

    page = config_reference.reference_markdown()
    section = ""
    for line in config_reference.reference().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            assert f"## [{section}]" in page
        elif re.match(r"\w+ = ", line):
            key = line.split(" = ")[0]
            assert f"| `{section}.{key}` |" in page



def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links if not re.match(r"[a-z]+:|#", link)]


def test_relative_links_in_readme_and_docs_point_at_files():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = [f"{page.relative_to(REPO)}: {link}" for page in pages
              for link in _relative_links(page.read_text()) if not (page.parent / link).exists()]
    assert not broken, f"links to missing files: {broken}"
