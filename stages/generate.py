"""Generate stage: sample the iteration's prompts with vLLM from the current policy version.

    python -m stages.generate --run-dir R --iteration K
"""

from __future__ import annotations

import pyarrow as pa

from hpcrl import data, generation, plan
from hpcrl.stage import StageContext, run_stage
from stages import cli_args


def requests_for(ctx: StageContext, tokenizer) -> list[tuple[generation.Request, ...]]:
    """(train requests, validation requests) of this iteration."""
    exp, k = ctx.exp, ctx.iteration
    train, val = (), ()
    if plan.trains(exp, k):
        prompts = data.prompt_set(exp, "train").table
        rows = data.draw_prompts(prompts.num_rows, exp.algorithm.prompts_per_iteration, k, exp.run.seed)
        train = tuple(_request("train", int(i), prompts, tokenizer) for i in rows)
    if plan.validates(exp, k):
        prompts = data.prompt_set(exp, "test").table
        n = min(prompts.num_rows, exp.data.max_val_prompts or prompts.num_rows)
        val = tuple(_request("val", i, prompts, tokenizer) for i in range(n))
    return train, val


def _request(split: str, i: int, prompts: pa.Table, tokenizer) -> generation.Request:
    return generation.Request(split, i, prompts["data_source"][i].as_py(),
                              data.render(tokenizer, prompts["prompt"][i].as_py()), prompts["ground_truth"][i].as_py())


def body(ctx: StageContext) -> None:
    exp, k = ctx.exp, ctx.iteration
    version = k  # iteration k samples from the policy after k updates
    if version > 0:
        ctx.input_dir("update", k - 1)
    ctx.policy_version = version
    with ctx.timed("startup"):
        generation.configure_env(exp)
        import vllm  # noqa: F401  (import cost is process start-up, not model loading)
    with ctx.timed("load"):
        llm = generation.make_engine(exp, ctx.run.policy_dir(version, exp.model.path), ctx.seed)
    with ctx.timed("io"):
        train, val = requests_for(ctx, llm.get_tokenizer())
    tables = []
    with ctx.timed("compute"):
        g = exp.generate
        if train:
            tables.append(generation.sample(llm, list(train), exp.algorithm.group_size, g.temperature, g.top_p,
                                            g.max_tokens, ctx.seed, k, version))
        if val:
            tables.append(generation.sample(llm, list(val), 1, 0.0, 1.0, g.max_tokens, ctx.seed, k, version))
    rollouts = pa.concat_tables(tables)
    with ctx.timed("io"):
        ctx.writer.write_table("rollouts", rollouts)
    lengths = [len(r) for r in rollouts["response_ids"].to_pylist()]
    train_lengths = lengths[: len(train) * exp.algorithm.group_size]
    m = ctx.writer.metrics
    m["perf/generated_tokens"] = float(sum(lengths))
    m["perf/throughput"] = sum(lengths) / max(ctx.timings["compute"], 1e-9)
    if train_lengths:
        m["response_length/mean"] = sum(train_lengths) / len(train_lengths)
        m["response_length/max"] = float(max(train_lengths))
        finish = rollouts["finish_reason"].to_pylist()[: len(train_lengths)]
        m["response_length/clip_ratio"] = finish.count("length") / len(finish)


def main(argv: list[str] | None = None) -> None:
    args = cli_args("generate", argv)
    run_stage("generate", args.run_dir, args.iteration, body)


if __name__ == "__main__":
    main()
