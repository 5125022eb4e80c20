"""Exporting a policy version as a standalone HF model folder (weights, config, tokenizer).

The result is a directory of copied files (never symlinks into the run), loadable by
transformers' `from_pretrained` and by vLLM, with an `hpcrl_export.json` saying where it came
from. Version v > 0 is the `policy/` folder (without a LoRA run's `policy/adapter/`, which
`adapters` exports alone, in peft's format) of the committed update of iteration v - 1: each copy
is checked against the sizes and sha256 of that update's manifest. Version 0 is the config's
`model.path` (with the tokenizer of `model.tokenizer` when that is set), and each copy is checked
against its source. The files are staged beside DIR and renamed into place, so an interrupted
export leaves no half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hpcrl import commit, pruning
from hpcrl.config import Experiment
from hpcrl.retention import POLICY
from hpcrl.rundir import RunDir
from hpcrl.stage_kinds import UPDATE

PROVENANCE = "hpcrl_export.json"
ADAPTER_DIR = "policy/adapter/"  # a LoRA run's adapters beside the merged policy (hpcrl.lora)


class ExportError(RuntimeError):
    """An export that is refused: the version does not exist, or the destination is not empty."""


def _policy_files(run: RunDir, model_path: str, version: int,
                  adapters: bool = False) -> tuple[dict[str, tuple[Path, dict | None]], str]:
    """{relative path: (source file, manifest entry or None)} of a version (or of its LoRA
    adapters), and where they come from."""
    if version == 0 and adapters:
        raise ExportError("policy version 0 has no adapters: it is the base model (model.path)")
    if version == 0:
        base = Path(model_path)
        if not (base / "config.json").is_file():
            raise ExportError(f"{base}: model.path of the run's config is not an HF model folder "
                              "(no config.json)")
        files = {str(p.relative_to(base)): (p, None) for p in sorted(base.rglob("*"))
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(base).parts)}
        return files, f"model.path {base}"
    stage = run.stage_dir(version - 1, UPDATE)
    manifest = commit.read_manifest(stage)  # CorruptOutputError when it is not JSON
    if manifest is None:
        raise ExportError(f"policy version {version} does not exist: the update of iteration {version - 1} "
                          f"({stage}) is not committed; see `hpcrl status {run.root}`")
    pruning.require(run, version, POLICY, f"export of policy version {version}")
    prefix = ADAPTER_DIR if adapters else "policy/"
    files = {rel[len(prefix):]: (stage / rel, meta) for rel, meta in sorted(manifest["files"].items())
             if rel.startswith(prefix) and (adapters or not rel.startswith(ADAPTER_DIR))}
    if not files and adapters:
        raise ExportError(f"policy version {version} has no LoRA adapters: its update trained every "
                          "weight (update.lora.rank = 0)")
    if not files:
        raise commit.CorruptOutputError(f"{stage / commit.MANIFEST}: lists no {prefix} files")
    return files, f"{stage / prefix.rstrip('/')} (committed update of iteration {version - 1})"


def _check_destination(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ExportError(f"{dest}: exists and is not a directory; choose a new directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise ExportError(f"{dest}: exists and is not empty; refusing to overwrite it "
                          "(choose a new directory)")


def export_policy(run: RunDir, exp: Experiment, version: int, dest: str | os.PathLike,
                  adapters: bool = False) -> list[Path]:
    """Copy policy `version` of the run (the merged model, or with `adapters` its LoRA adapters)
    into `dest` (new or empty); returns the files written."""
    dest = Path(dest).absolute()
    last = exp.run.iterations
    if not 0 <= version <= last:
        raise ExportError(f"policy version {version} is out of range: this run has versions 0..{last}")
    _check_destination(dest)
    files, origin = _policy_files(run, exp.model.path, version, adapters)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        written, digests = [], {}
        for rel, (src, meta) in files.items():
            if not src.is_file():
                raise commit.CorruptOutputError(f"{src}: missing (a file of policy version {version})")
            expected = meta["sha256"] if meta else commit.file_digest(src)[7:]
            size = meta["bytes"] if meta else src.stat().st_size
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)  # follows symlinks: the export holds the bytes
            if target.stat().st_size != size or commit.file_digest(target)[7:] != expected:
                against = "its manifest" if meta else "its source after copying"
                raise commit.CorruptOutputError(f"{src}: size or checksum mismatch with {against}")
            written.append(dest / rel)
            digests[rel] = expected
        if version == 0 and exp.model.tokenizer and Path(exp.model.tokenizer) != Path(exp.model.path):
            from hpcrl import policy_model

            before = set(tmp.rglob("*"))
            policy_model.save_tokenizer(exp.model.tokenizer, tmp)
            written += [dest / p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file() and p not in before]
        provenance = {"run": str(run.root), "run_id": run.read_run_info().get("run_id"), "version": version,
                      "source": origin, "sha256": digests}
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        written.append(dest / PROVENANCE)
        if dest.is_dir():
            dest.rmdir()  # empty (checked above)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written
