"""The full family matrix: every tiny family model (tools/tiny_models.py) trained for two
iterations of the demo in the resident and the staged mode, with the sync probe on, and a
trainer that computes another model (Gemma-2 without soft-capping) refused before the first
iteration. Prints a table: the trainer-vLLM difference before training, the probe after each
resident sync, the staged updates' trainer-sampler difference.

    python tools/family_matrix.py --out /tmp/matrix [--family mixtral ...] [--modes resident]

About 3 min per family and mode pair on the 2-core CPU machine. The fast part (the sync of every
family into a real vLLM engine) is tests/test_families.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import tiny_models  # noqa: E402

# A reward that varies on a random model (an exact match is 0 everywhere: no gradient, and a
# probe that cannot tell a skipped sync from a good one).
REWARD = '''
def digit_share(response, ground_truth, **_):
    return {"score": sum(c.isdigit() for c in response) / max(len(response), 1)}
'''
SETTINGS = {"run.iterations": 2, "run.eval_every": 0, "algorithm.prompts_per_iteration": 8,
            "algorithm.group_size": 4, "update.lr": 1e-3, "reward.functions": ["family_reward:digit_share"]}
RESIDENT = {"executor.resident.sync_check_tol": 1e-5}  # float32: the probe at 1e-5, not the default 1e-4


def submit(out: Path, model: Path, name: str, mode: str, **extra) -> subprocess.CompletedProcess:
    sets = {**SETTINGS, "model.path": str(model), "run.name": name, "run.runs_root": str(out / "runs"),
            "executor.mode": mode, **(RESIDENT if mode == "resident" else {}), **extra}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {**os.environ, "PYTHONPATH": f"{out}:{REPO}", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(REPO / "configs" / "demo.toml"),
                           *args], capture_output=True, text=True, env=env, timeout=1800)


def manifests(run: Path, stage: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run.glob(f"iter_*/{stage}/_COMMIT.json"))]


def row(out: Path, family: str, mode: str) -> dict:
    t0 = time.time()
    name = f"{family}-{mode}"
    done = submit(out, out / "models" / family, name, mode)
    run = out / "runs" / name
    r = {"family": family, "mode": mode, "ok": done.returncode == 0, "s": round(time.time() - t0)}
    if not r["ok"]:
        r["error"] = (done.stdout + done.stderr).strip().splitlines()[-1][:200]
        return r
    gen, upd = manifests(run, "generate"), manifests(run, "update")
    r["start"] = gen[0]["metrics"].get("sync/start_logp_diff")
    r["probe"] = [m["metrics"]["sync/logp_diff"] for m in gen if "sync/logp_diff" in m["metrics"]]
    r["mismatch"] = [m["metrics"]["rollout/logprob_diff_mean"] for m in upd]
    r["attn"] = upd[0].get("notes", {}).get("attn_implementation")
    return r


def refused(out: Path) -> dict:
    """Gemma-2 with the trainer on sdpa (no soft-capping): refused before the first iteration."""
    t0 = time.time()
    done = submit(out, out / "models" / "gemma2", "gemma2-sdpa", "resident",
                  **{"model.attn_implementation": "sdpa"})
    text = done.stdout + done.stderr
    generated = list((out / "runs" / "gemma2-sdpa").glob("iter_*/generate/_COMMIT.json"))
    line = next((ln for ln in text.splitlines() if "before any update" in ln), "")
    return {"family": "gemma2 (trainer on sdpa)", "mode": "resident", "s": round(time.time() - t0),
            "ok": done.returncode != 0 and not generated and bool(line), "error": line.strip()[:300]}


def fmt(values) -> str:
    if values is None:
        return "-"
    if isinstance(values, list):
        return ", ".join(f"{v:.1e}" for v in values)
    return f"{values:.1e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--family", action="append", choices=sorted(tiny_models.FAMILIES))
    p.add_argument("--modes", nargs="+", default=["resident", "staged"])
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "family_reward.py").write_text(REWARD)
    families = args.family or list(tiny_models.FAMILIES)
    for family in {*families, "gemma2"}:
        tiny_models.build(family, args.out / "models" / family)
    rows = [row(args.out, f, m) for f in families for m in args.modes]
    rows.append(refused(args.out))
    print("| family | mode | passed | trainer vs vLLM before training | probe after each sync | "
          "trainer vs sampler per update | trainer attention | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['mode']} | {'yes' if r['ok'] else 'NO'} | {fmt(r.get('start'))} | "
              f"{fmt(r.get('probe'))} | {fmt(r.get('mismatch'))} | {r.get('attn') or '-'} | {r['s']} |")
        if r.get("error"):
            print(f"|  | {r['error']} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
