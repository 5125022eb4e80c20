"""`hpcrl export`: a committed policy version becomes a standalone HF folder that loads to the same
weights; existing destinations, uncommitted versions and corrupted files are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpcrl import commit
from hpcrl.export import PROVENANCE
from tests import synthetic_run


def hpcrl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def state(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def trained(tiny_task, tmp_path_factory) -> Path:
    """The tiny model with perturbed weights (what an update would write), as an HF folder."""
    out = tmp_path_factory.mktemp("policy")
    model = AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_task / "model").save_pretrained(out)
    return out


@pytest.fixture
def run(tmp_path, tiny_task, trained):
    return synthetic_run.make_run(tmp_path / "runs" / "exp", iterations=2, rows=16, val_rows=0, group_size=4,
                                  policy_from=trained, model_path=tiny_task / "model")


def test_export_of_a_committed_version_loads_to_the_same_weights(run, tmp_path, tiny_task, trained):
    dest = tmp_path / "export" / "v1"
    out = hpcrl("export", run.root, "--version", 1, dest)
    assert out.returncode == 0, out.stderr
    assert f"exported policy v1 of {run.root} to {dest}" in out.stdout
    listed = {k[len("policy/"):] for k in commit.read_manifest(run.stage_dir(0, "update"))["files"]
              if k.startswith("policy/")}
    assert {p.name for p in dest.iterdir()} == listed | {PROVENANCE}
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= listed
    exported = state(dest)
    assert_same_weights(exported, state(trained))
    assert not torch.equal(exported["lm_head.weight"], state(tiny_task / "model")["lm_head.weight"])
    assert AutoTokenizer.from_pretrained(dest)("12+34=").input_ids == \
        AutoTokenizer.from_pretrained(tiny_task / "model")("12+34=").input_ids
    provenance = json.loads((dest / PROVENANCE).read_text())
    assert provenance["version"] == 1 and provenance["run"] == str(run.root)


def test_version_0_is_the_base_model(run, tmp_path, tiny_task):
    dest = tmp_path / "v0"
    dest.mkdir()  # an empty directory is accepted
    out = hpcrl("export", run.root, "--version", 0, dest)
    assert out.returncode == 0, out.stderr
    assert_same_weights(state(dest), state(tiny_task / "model"))


def test_refusals(run, tmp_path):
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    out = hpcrl("export", run.root, "--version", 1, dest)
    assert out.returncode == 2 and f"{dest}: exists and is not empty; refusing to overwrite" in out.stderr
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    out = hpcrl("export", run.root, "--version", 3, tmp_path / "new")
    assert (out.returncode == 2
            and "policy version 3 is out of range: this run has versions 0..2" in out.stderr)
    (run.stage_dir(1, "update") / commit.MANIFEST).unlink()  # as if the update of iteration 1 never committed
    out = hpcrl("export", run.root, "--version", 2, tmp_path / "new")
    assert out.returncode == 2
    assert ("policy version 2 does not exist: the update of iteration 1" in out.stderr
            and "not committed" in out.stderr)
    assert not (tmp_path / "new").exists() and "Traceback" not in out.stderr


def test_corrupted_weights_are_named_and_nothing_is_left(run, tmp_path):
    weights = run.stage_dir(0, "update") / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    dest = tmp_path / "v1"
    out = hpcrl("export", run.root, "--version", 1, dest)
    assert out.returncode == 1
    assert f"error: {weights}: size or checksum mismatch with its manifest" in out.stderr
    assert "Traceback" not in out.stderr
    assert not dest.exists() and not list(tmp_path.glob(".v1.export-tmp"))


def test_a_saved_tokenizer_has_the_same_bytes_whether_the_hub_was_reachable(tiny_task, tmp_path, monkeypatch):
    """Pins `policy_model.save_tokenizer`: transformers saves how a tokenizer was loaded
    (`local_files_only` follows HF_HUB_OFFLINE, which stage jobs set and a resident trainer's
    process may not have), which made a policy's tokenizer_config.json differ between a run and
    its replay."""
    import huggingface_hub.constants as hub

    from hpcrl import policy_model

    saved = []
    for offline in (False, True):
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", offline)
        out = tmp_path / f"offline-{offline}"
        policy_model.save_tokenizer(tiny_task / "model", out)
        saved.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert saved[0] == saved[1] and "tokenizer_config.json" in saved[0]
    assert not set(json.loads(saved[0]["tokenizer_config.json"])) & set(policy_model.LOADING_KWARGS)
    text = "12+34="
    assert (AutoTokenizer.from_pretrained(tmp_path / "offline-True")(text).input_ids
            == AutoTokenizer.from_pretrained(tiny_task / "model")(text).input_ids)
