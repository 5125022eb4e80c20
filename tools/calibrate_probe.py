"""The weight-sync probe's tolerance, measured: for the demo's trained model and tiny random models
of every family (tools/tiny_models.py), the trainer's model (hpcrl.policy_model, loaded as the
actor loads it, the probe batched as the trainer batches it) and a vLLM engine over the same
weights compute the resident mode's probe logprobs (hpcrl.resident_sync.probe_sequences). The
table gives their mean and largest |difference| per dtype, against the tolerance hpcrl applies
(hpcrl.weight_sync.probe_tolerance) and how much a small update moves the probe in that dtype
(every weight moved by 1e-3 of its scale: what a skipped sync must be told apart from).

    python tools/calibrate_probe.py [--families qwen2 llama3 ...] [--dtypes float32,bfloat16]

One process per model and dtype (a vLLM engine keeps process-wide state); about 15 s each on the
2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

TASK = Path(os.environ.get("HPCRL_TINY_TASK_DIR", REPO / ".cache" / "tiny-addition"))  # as tests/conftest.py


def experiment(model: Path, dtype: str, out: Path):
    """A resident experiment over `model` in `dtype` with the tiny task's prompts (for the probe)."""
    from hpcrl import config

    path = out / f"{model.name}-{dtype}.toml"
    path.write_text(f'''[run]
name = "calibrate"
runs_root = "{out}"
[model]
path = "{model}"
dtype = "{dtype}"
max_model_len = 64
[data]
train = "{TASK / 'data' / 'train.parquet'}"
[generate]
kv_cache_gib = 0.25
max_tokens = 8
''')
    return config.load(path)


def measure(model: Path, dtype: str) -> dict:
    """The trainer-vLLM probe difference for `model` in `dtype`, and the shift of a small update."""
    import torch

    from hpcrl import generation, policy_model, resident_sync

    with tempfile.TemporaryDirectory() as tmp:
        exp = experiment(model, dtype, Path(tmp))
        torch_dtype = getattr(torch, dtype)
        trainer = policy_model.load_causal_lm(model, torch_dtype, exp.model.attn_implementation).eval()
        llm = generation.make_engine(exp, model, 0)
        tokenizer = llm.get_tokenizer()
        probe = resident_sync.probe_sequences(exp, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ours = policy_model.sequence_logprobs(trainer, probe, pad, "cpu")
        theirs = resident_sync.engine_logprobs(llm, probe)
        diff = _diffs(ours, theirs)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a small update: every weight moved by 1e-3 of its scale
            for p in trainer.parameters():
                scale = p.float().std().nan_to_num(1.0)
                p.add_((torch.randn(p.shape, generator=g) * 1e-3 * scale).to(p.dtype))
        shift = _diffs(ours, policy_model.sequence_logprobs(trainer, probe, pad, "cpu"))
    return {"mean": diff.mean().item(), "max": diff.max().item(), "shift": shift.mean().item(),
            "tokens": diff.numel()}


def _diffs(a: list[list[float]], b: list[list[float]]):
    import torch

    return torch.tensor([abs(x - y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True)])


def models(families: list[str], out: Path) -> dict[str, Path]:
    import tiny_models

    found = {"demo (trained)": TASK / "model"}
    for family in families:
        found[family] = tiny_models.build(family, out / family, TASK / "model")
    return found


def main(argv: list[str] | None = None) -> int:
    import tiny_models

    from hpcrl import weight_sync

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=sorted(tiny_models.FAMILIES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(Path(args.one[0]).resolve(), args.one[1])))
        return 0
    subprocess.run([sys.executable, str(REPO / "tools" / "build_tiny_task.py"), "--out", str(TASK)],
                   check=True)
    print("| model | dtype | probe tokens | mean diff | largest diff | tolerance | small update's shift |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(args.families, Path(tmp)).items():
            for dtype in args.dtypes.split(","):
                out = subprocess.run([sys.executable, __file__, "--one", str(path), dtype],
                                     capture_output=True, text=True)
                if out.returncode:
                    why = out.stderr.strip().splitlines()[-1]
                    print(f"| {name} | {dtype} | failed: {why} |||||", flush=True)
                    continue
                m = json.loads(out.stdout.strip().splitlines()[-1])
                tol = weight_sync.probe_tolerance(0.0, dtype)
                print(f"| {name} | {dtype} | {m['tokens']} | {m['mean']:.1e} | {m['max']:.1e} | {tol:.0e} | "
                      f"{m['shift']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
