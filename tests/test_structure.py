"""The code's shape, checked from its source: small modules and functions, one-way imports, and
stage kinds named in one place (hpcrl.stage_kinds)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from hpcrl import stage_kinds

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "hpcrl").glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _imports(path: Path) -> set[str]:
    """The hpcrl modules `path` imports anywhere (in functions and under TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hpcrl":
            parts = node.module.split(".")
            out |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hpcrl.")}
    return out & {p.stem for p in PACKAGE}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    return found


def test_no_import_cycle_in_the_package():
    graph = {p.stem: _imports(p) for p in PACKAGE}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check sees one
    assert graph["stage_kinds"] == set()  # everything may import the registry


def test_modules_and_functions_are_small():
    long_modules = {p.name: n for p in PACKAGE if (n := len(p.read_text().splitlines())) > 400}
    long_functions = {f"{p.name}:{node.name}": node.end_lineno - node.lineno + 1
                      for p in PACKAGE for node in ast.walk(_tree(p))
                      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                      and node.end_lineno - node.lineno + 1 > 60}
    assert long_modules == {} and long_functions == {}


# "score" is also the name of the main reward component a reward function returns.
COMPONENT = {"rewards.py": {"score"}, "reward_backends.py": {"score"}}


def test_a_pyarrow_submodule_is_used_only_where_it_is_imported():
    """`pa.compute.equal` works only where some other import loaded pyarrow.compute first (reading
    a table with pq.read_table did): a trainer process that read its tables another way failed."""
    used = {}
    for path in [*PACKAGE, *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "tools").glob("*.py"))]:
        text = path.read_text() if path != Path(__file__).resolve() else ""
        subs = re.findall(r"\bpa\.(compute|dataset|json|csv|ipc|fs|parquet|feather|flight)\.", text)
        missing = {sub for sub in subs if not re.search(rf"^\s*(import|from) pyarrow\.{sub}\b", text, re.M)}
        if missing:
            used[path.name] = sorted(missing)
    assert used == {}


def test_a_stage_name_is_written_out_only_in_the_registry():
    """Elsewhere the package names a stage kind through hpcrl.stage_kinds' constants."""
    names = set(stage_kinds.KINDS)
    found = {}
    for p in [*PACKAGE, *(ROOT / "stages").glob("*.py")]:
        if p.name == "stage_kinds.py":
            continue
        literals = {n.value for n in ast.walk(_tree(p)) if isinstance(n, ast.Constant) and n.value in names}
        if literals - COMPONENT.get(p.name, set()):
            found[str(p.relative_to(ROOT))] = sorted(literals)
    assert found == {}


@pytest.mark.parametrize("name", list(stage_kinds.KINDS))
def test_each_stage_kind_has_its_object_and_a_thin_job_entry_point(name):
    from hpcrl.stage import Stage

    kind = stage_kinds.kind(name)
    cls = kind.stage_class()
    assert issubclass(cls, Stage) and cls.name == name
    entry = ROOT / "stages" / f"{name}.py"
    assert len(entry.read_text().splitlines()) <= 15
    assert all(k in stage_kinds.KINDS and offset <= 0 for offset, k in kind.reads)


def test_the_registry_says_what_a_stage_reads():
    assert stage_kinds.kind("update").inputs(0, 0) == [(0, "generate"), (0, "score")]
    assert stage_kinds.kind("update").inputs(3, 3) == [(3, "generate"), (3, "score"), (2, "update")]
    assert (stage_kinds.kind("generate").inputs(0, 0) == []
            and stage_kinds.kind("score").inputs(2, 2) == [(2, "generate")])
    # a generation reads the update that made the policy it samples with (older with staleness)
    assert stage_kinds.kind("generate").inputs(3, 3) == [(2, "update")]
    assert stage_kinds.kind("generate").inputs(3, 2) == [(1, "update")]
    with pytest.raises(ValueError, match="unknown stage 'reward'; expected one of generate, score, update"):
        stage_kinds.kind("reward")
