#!/usr/bin/env python
"""The demo's sampling with vLLM detokenizing against token ids only and one batch decode
(hpcrl.generation.sample's way), side by side in one process on one engine.

    python tools/bench_sampling.py [--config configs/demo.toml] [--rounds 10] [--repeats 3]

Each batch samples the config's first iteration (prompts_per_iteration x group_size, seeded per
prompt, logprobs of the sampled tokens) with a fresh seed; each repeat runs `rounds` batches one
way, then `rounds` the other. The table gives the median wall time per batch, and the count of
texts the two ways spell apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcrl import config, generation  # noqa: E402


def texts(llm, requests, exp, seed: int, detokenize: bool) -> list[str]:
    """The batch's texts: vLLM's, detokenizing every token (and decoding each logprob's token), or
    its token ids decoded in one batch (hpcrl.generation.response_texts)."""
    from vllm import SamplingParams

    a, g = exp.algorithm, exp.generate
    params = [SamplingParams(n=a.group_size, temperature=g.temperature, top_p=g.top_p,
                             max_tokens=g.max_tokens, logprobs=0, seed=seed + r.prompt_index,
                             detokenize=detokenize)
              for r in requests]
    outs = llm.generate([r.prompt_text for r in requests], params, use_tqdm=False)
    done = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    if detokenize:
        return [c.text for c in done]
    return generation.response_texts(llm.get_tokenizer(), [list(c.token_ids) for c in done])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    exp = config.load(Path(args.config))
    llm = generation.make_engine(exp, Path(exp.model.path), exp.run.seed)
    requests = list(generation.train_requests(exp, 0, llm.get_tokenizer()))
    a, g = exp.algorithm, exp.generate
    names = {True: "vLLM detokenizes", False: "ids, one batch decode"}
    times: dict[str, list[float]] = {name: [] for name in names.values()}
    spelled: dict[bool, dict[int, list[str]]] = {True: {}, False: {}}
    for rep in range(args.repeats):
        for detokenize, name in names.items():  # in blocks: one way's garbage is not collected in the other's
            for r in range(args.rounds + 1):
                seed = 1000 * (rep * (args.rounds + 1) + r)  # the same batches both ways
                t0 = time.perf_counter()
                spelled[detokenize][seed] = texts(llm, requests, exp, seed, detokenize)
                if r:  # the first batch of a block warms it
                    times[name].append(time.perf_counter() - t0)
    differ = sum(x != y for seed, ours in spelled[False].items()
                 for x, y in zip(ours, spelled[True][seed], strict=True))
    base = statistics.median(times["vLLM detokenizes"])
    print(f"{len(requests)} prompts x {a.group_size} samples x {g.max_tokens} tokens, "
          f"median of {args.rounds * args.repeats} batches; texts that differ: {differ} (a response cut "
          "inside a multi-byte character, hpcrl.generation.response_texts)")
    print("| sampling | ms per batch | vs vLLM detokenizing |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.1f} | {base / statistics.median(ts):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
