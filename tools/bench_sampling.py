#!/usr/bin/env python
"""hpcrl's sampling (hpcrl.generation.sample) against vLLM's defaults, side by side in one process
on one engine.

    python tools/bench_sampling.py [--config configs/demo.toml] [--rounds 10] [--repeats 3]
                                   [--set generate.max_tokens=48 ...]

Each batch samples the config's first iteration (prompts_per_iteration x group_size, seeded per
prompt, logprobs of the sampled tokens) with a fresh seed, three ways:
  vLLM's defaults: text prompts, which vLLM tokenizes one by one; vLLM detokenizes every sampled
      token, and returns a dict per token for its logprob;
  ids out: the same, but vLLM returns token ids only (detokenize=False), decoded in one batch;
  hpcrl: `generation.sample`, which also sends the prompts as token ids (tokenized in one batch)
      and takes the logprobs as flat lists (flat_logprobs).
Each repeat runs `rounds` batches one way, then the next. The table gives the median wall time per
batch; every way must give the same prompt ids, response ids, logprobs and texts (a response cut
inside a multi-byte character aside: its text differs, hpcrl.generation.response_texts).
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


def by_vllm(llm, requests, exp, seed: int, detokenize: bool) -> dict[str, list]:
    """A batch as vLLM's LLM.generate gives it for text prompts (dict logprobs); its texts vLLM's own
    (detokenize) or its token ids decoded in one batch."""
    from vllm import SamplingParams

    a, g = exp.algorithm, exp.generate
    params = [SamplingParams(n=a.group_size, temperature=g.temperature, top_p=g.top_p,
                             max_tokens=g.max_tokens, logprobs=0, seed=seed + r.prompt_index,
                             detokenize=detokenize)
              for r in requests]
    outs = llm.generate([r.prompt_text for r in requests], params, use_tqdm=False)
    pairs = [(o, c) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    ids = [list(c.token_ids) for _, c in pairs]
    texts = ([c.text for _, c in pairs] if detokenize
             else generation.response_texts(llm.get_tokenizer(), ids))
    return {"prompt_ids": [list(o.prompt_token_ids) for o, _ in pairs], "response_ids": ids,
            "logprobs": [[step[t].logprob for step, t in zip(c.logprobs, i, strict=True)]
                         for (_, c), i in zip(pairs, ids, strict=True)],
            "response_text": texts}


def by_hpcrl(llm, requests, exp, seed: int) -> dict[str, list]:
    a, g = exp.algorithm, exp.generate
    table = generation.sample(llm, list(requests), a.group_size, g.temperature, g.top_p, g.max_tokens,
                              seed, 0, 0)
    return {k: table[k].to_pylist() for k in ("prompt_ids", "response_ids", "logprobs", "response_text")}


WAYS = {"vLLM's defaults": lambda *a: by_vllm(*a, detokenize=True),
        "ids out": lambda *a: by_vllm(*a, detokenize=False),
        "hpcrl": by_hpcrl}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (TOML value), e.g. generate.max_tokens=48")
    args = parser.parse_args(argv)
    exp = config.load(Path(args.config))
    if args.set:
        exp = config.with_overrides(exp, config.parse_assignments(args.set), "--set")
    llm = generation.make_engine(exp, Path(exp.model.path), exp.run.seed)
    requests = list(generation.train_requests(exp, 0, llm.get_tokenizer()))
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    got: dict[str, dict[int, dict]] = {name: {} for name in WAYS}
    for rep in range(args.repeats):
        for name, way in WAYS.items():  # in blocks: one way's garbage is not collected in another's
            for r in range(args.rounds + 1):
                seed = 1000 * (rep * (args.rounds + 1) + r)  # the same batches every way
                t0 = time.perf_counter()
                got[name][seed] = way(llm, requests, exp, seed)
                if r:  # the first batch of a block warms it
                    times[name].append(time.perf_counter() - t0)
    base = got["vLLM's defaults"]
    for name in WAYS:
        for column in ("prompt_ids", "response_ids", "logprobs"):
            if any(got[name][seed][column] != batch[column] for seed, batch in base.items()):
                raise SystemExit(f"{name}: its {column} differ from vLLM's defaults")
    differ = sum(x != y for seed, batch in base.items()
                 for x, y in zip(got["hpcrl"][seed]["response_text"], batch["response_text"], strict=True))
    tokens = statistics.mean(sum(map(len, b["response_ids"])) for b in base.values())
    a, g = exp.algorithm, exp.generate
    print(f"{len(requests)} prompts x {a.group_size} samples, at most {g.max_tokens} tokens "
          f"({tokens:.0f} sampled per batch on average); median of {args.rounds * args.repeats} batches; "
          f"the same ids and logprobs every way; texts that differ: {differ} (a response cut inside a "
          "multi-byte character, hpcrl.generation.response_texts)")
    slowest = statistics.median(times["vLLM's defaults"])
    print("| sampling | ms per batch | speed-up over vLLM's defaults |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.1f} | {slowest / statistics.median(ts):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
