#!/usr/bin/env python
"""Loading a full set of new weights into a running vLLM engine on CPU, two ways side by side in one
engine: vLLM's layer-wise in-place reload (with hpcrl's refresh of what it leaves stale), and
hpcrl's direct load into kept weights (hpcrl.vllm_ext.DirectLoad), for the demo's model and the
~100M model of tools/bench_resident.py.

    python tools/bench_engine_load.py [--models demo,100m] [--repeats 20] [--cpu 1]

The weights are the model's own checkpoint, read into memory once: the time is the load alone
(no transport). The layer-wise loads run first: the direct load keeps the linear layers' weights,
which the layer-wise reload would drop again. The engine's outputs are checked unchanged after
each way (greedy tokens of a few prompts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench_resident import model_overrides  # tools/, this script's directory

from hpcrl import config, generation

REPO = Path(__file__).resolve().parents[1]


def time_loads(worker, path: str, repeats: int) -> dict[str, list[float]]:
    """Run in the vLLM worker: `repeats` layer-wise reloads, then `repeats` direct loads."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    from hpcrl import vllm_ext

    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    model = worker.model_runner.get_model()
    out: dict[str, list[float]] = {"layer-wise reload": [], "direct load": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        worker.reload_weights(weights_iterator=iter(list(weights.items())))
        vllm_ext.refresh_cpu_copies(model)
        out["layer-wise reload"].append(time.perf_counter() - t0)
    load = vllm_ext.DirectLoad.of(model, worker.vllm_config.model_config.quantization)
    for _ in range(repeats):
        t0 = time.perf_counter()
        with set_current_vllm_config(worker.vllm_config):
            load(model, iter(list(weights.items())))
        out["direct load"].append(time.perf_counter() - t0)
    return out


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(["1+2=", "40+17=", "8+80="], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def measure(model: str, repeats: int) -> dict[str, float]:
    exp = config.with_overrides(config.load(REPO / "configs" / "demo.toml"),
                                model_overrides(model), "bench")
    path = Path(exp.model.path)
    llm = generation.make_engine(exp, path, 0)
    before = greedy(llm)
    times = llm.collective_rpc(time_loads, args=(str(path), repeats))[0]
    if greedy(llm) != before:
        raise RuntimeError(f"{model}: the engine's outputs changed after loading its own weights")
    generation.shutdown_engine(llm)
    return {way: statistics.median(ts) for way, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,100m")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cpu", type=int, default=1, help="the core the engine runs on")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    rows = {m: measure(m, args.repeats) for m in args.models.split(",")}
    print(f"median of {args.repeats} loads of the model's own weights into a running engine, "
          f"on core {args.cpu}")
    print("| model | layer-wise reload ms | direct load ms | speed-up |")
    print("|---|---|---|---|")
    for m, r in rows.items():
        lw, d = r["layer-wise reload"], r["direct load"]
        print(f"| {m} | {lw * 1000:.1f} | {d * 1000:.1f} | {lw / d:.1f}x |")


if __name__ == "__main__":
    main()
