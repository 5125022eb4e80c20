"""Reward backends: a tiny locally built reward model against a direct HF forward pass, an HTTP
reward service started by the test (batching, concurrency, retries, and clear errors when it is
down, slow or wrong), weights and components in the reward, and a score stage that commits
nothing when its service is down."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from hpcrl import commit, config, rewards, scoring
from hpcrl.config import ConfigError, RewardConfig, RewardHttpConfig, RewardModelConfig
from hpcrl.reward_backends import HttpReward, RewardBackendError, RewardModel, inspect_model
from hpcrl.rundir import RunDir
from tests import synthetic_run

pytestmark = pytest.mark.timeout(120)

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
RESPONSES = ["46", "0046", "4", "46 is the sum of 12 and 34", "46<|im_end|>"]


def _samples(responses=RESPONSES) -> list[dict]:
    return [{"prompt": PROMPT, "response": r, "ground_truth": "46", "data_source": "tiny"} for r in responses]


# ---------------------------------------------------------------- reward model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_task) -> Path:
    """A tiny Qwen2ForSequenceClassification (random weights) with the tiny task's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_task / "model")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                      pad_token_id=tok.pad_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("reward-model")
    Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _direct(path: Path, texts: list[str]) -> list[float]:
    """One unpadded HF forward pass per text."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]


def test_reward_model_scores_equal_a_direct_forward_pass(classifier):
    rm = RewardModel(RewardModelConfig(path=str(classifier), batch_size=2, device="cpu"))  # padded batches
    got = rm(_samples())
    assert got == pytest.approx(_direct(classifier, [PROMPT + r for r in RESPONSES]), abs=1e-5)
    assert len(set(got)) == len(got)  # the responses are told apart
    assert rm([]) == []


def test_reward_model_cuts_long_samples_from_the_start(classifier):
    from transformers import AutoTokenizer

    rm = RewardModel(RewardModelConfig(path=str(classifier), max_length=8))
    text = PROMPT + RESPONSES[3]
    ids = AutoTokenizer.from_pretrained(classifier)(text)["input_ids"]
    assert len(ids) > 8
    tail = AutoTokenizer.from_pretrained(classifier).decode(ids[-8:])
    assert rm(_samples([RESPONSES[3]])) == pytest.approx(_direct(classifier, [tail]), abs=1e-5)


def test_reward_model_weight_and_component_in_the_reward(classifier, tiny_task):
    cfg = RewardConfig(functions=["hpcrl.rewards:exact_match"],
                       model=RewardModelConfig(path=str(classifier), weight=0.5, batch_size=3))
    sources, weights = scoring.load_sources(cfg)
    assert list(sources) == ["hpcrl.rewards:exact_match", "model"] and weights["model"] == 0.5
    table = scoring.score(_rollouts(RESPONSES), sources, weights)
    model = _direct(classifier, [PROMPT + r for r in RESPONSES])
    exact = [1.0, 0.0, 0.0, 0.0, 0.0]
    comps = [dict(c) for c in table["reward_components"].to_pylist()]
    assert [c["model"] for c in comps] == pytest.approx(model, abs=1e-5)
    assert (table["reward"].to_pylist()
            == pytest.approx([e + 0.5 * m for e, m in zip(exact, model, strict=True)], abs=1e-5))


def test_reward_model_directory_problems_are_named(classifier, tiny_task, tmp_path):
    with pytest.raises(RewardBackendError, match=r"no config\.json"):
        inspect_model(str(tmp_path))
    with pytest.raises(RewardBackendError,
                       match=r"\['Qwen2ForCausalLM'\] is not a sequence-classification model"):
        inspect_model(str(tiny_task / "model"))  # the policy, not a reward model
    cfg, tok = inspect_model(str(classifier))
    assert cfg.num_labels == 1 and tok.pad_token_id is not None


def test_preflight_names_a_reward_model_that_is_not_one(write_experiment, tiny_task):
    from hpcrl import preflight

    path = write_experiment(reward={"model": {"path": str(tiny_task / "model")}})
    with pytest.raises(ConfigError) as err:
        preflight.check(config.load(path), str(path))
    assert f"reward.model.path: reward model {tiny_task / 'model'}: architectures" in str(err.value)


def test_preflight_refuses_a_cuda_reward_model_in_a_job_without_gpus(write_experiment, classifier):
    """Slurm and the local executor alike give a job with gpus_per_node = 0 no GPU; the job that
    scores is the score job, or in the resident mode the resident job."""
    from hpcrl import preflight

    reward = {"model": {"path": str(classifier), "device": "cuda"}}
    for executor, role in [({"kind": "local"}, "score"), ({"kind": "slurm"}, "score"),
                           ({"kind": "local", "mode": "resident"}, "resident")]:
        exp = config.load(write_experiment(f"rm-{role}", reward=reward, executor=executor))
        assert (f"reward.model.device: 'cuda' but executor.{role}.gpus_per_node = 0 gives the {role} job "
                "no GPU") in preflight._check_rewards(exp)
        with_gpu = config.with_overrides(exp, {f"executor.{role}.gpus_per_node": 1}, "test")
        assert preflight._check_rewards(with_gpu) == []


# ---------------------------------------------------------------- config


def _parse(reward: dict) -> config.Experiment:
    return config.parse({"model": {"path": "m"}, "data": {"train": "t.parquet"}, "reward": reward}, "x.toml",
                        Path("/cfg"))


def test_config_resolves_the_reward_model_path_and_names_bad_backend_keys():
    assert _parse({"model": {"path": "rm"}}).reward.model.path == "/cfg/rm"
    for reward, expected in [
        ({"http": {"url": "ftp://rm:80/score"}},
         "reward.http.url: Value error, expected an http:// or https:// URL"),
        ({"http": {"url": "http://rm:port/score"}},
         "reward.http.url: Value error, expected an http:// or https:// URL with a valid port"),
        ({"http": {"url": "http://rm/", "concurrency": 0}},
         "reward.http.concurrency: Input should be greater than or equal to 1"),
        ({"model": {"path": "rm", "device": "tpu"}},
         "reward.model.device: Input should be 'auto', 'cpu' or 'cuda'"),
        ({"model": {"pth": "rm"}}, "reward.model.pth: unknown key in [reward.model]"),
        ({"functions": []},
         "reward: no reward source: expected reward.functions, reward.model.path or reward.http.url"),
    ]:
        with pytest.raises(ConfigError) as err:
            _parse(reward)
        assert expected in str(err.value)
    assert (_parse({"functions": [], "http": {"url": "https://rm.example:8443/v1/score"}}).reward.http.weight
            == 1.0)


# ---------------------------------------------------------------- HTTP service


class Service:
    """A reward service on 127.0.0.1 that scores a response by its length and records its requests.

    mode: ok | plain (bare numbers) | flaky (HTTP 503 for the first `failures` requests) | slow
    (sleeps 3 s) | bad_json | wrong_count | nan | http400."""

    def __init__(self):
        self.mode, self.failures, self.delay = "ok", 0, 0.0
        self.batch_sizes: list[int] = []
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def answer(self, samples: list[dict]) -> tuple[int, str]:
        with self.lock:
            self.batch_sizes.append(len(samples))
            flaky = self.mode == "flaky" and len(self.batch_sizes) <= self.failures
        if flaky:
            return 503, "warming up"
        if self.mode == "slow":
            self.release.wait(60)  # answers only once the test is over
        scores = [{"score": len(s["response"]), "digits": float(s["response"].isdigit()),
                   "message": "long" if len(s["response"]) > 5 else ""} for s in samples]
        body = {"ok": {"scores": scores}, "flaky": {"scores": scores}, "slow": {"scores": scores},
                "plain": {"scores": [len(s["response"]) for s in samples]},
                "wrong_count": {"scores": scores[1:]}, "nan": {"scores": [float("nan")] * len(samples)},
                "huge": {"scores": scores, "padding": "x" * 5000}, "trickle": {"scores": scores},
                "http400": {"error": "no"}}.get(self.mode)
        return (400 if self.mode == "http400" else 200), ("{not json" if body is None else json.dumps(body))

    def _handler(self):
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                samples = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["samples"]
                with service.lock:
                    service.inflight += 1
                    service.max_inflight = max(service.max_inflight, service.inflight)
                time.sleep(service.delay)
                status, text = service.answer(samples)
                with service.lock:
                    service.inflight -= 1
                if service.mode == "trickle":  # each byte in time for a read timeout, the whole far too late
                    return self._trickle(text.encode())
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(text.encode())))
                    self.end_headers()
                    self.wfile.write(text.encode())
                except OSError:
                    pass  # the client gave up (the timeout test)

            def _trickle(self, body: bytes):
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for i in range(len(body)):
                        self.wfile.write(body[i: i + 1])
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        return Handler

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)  # the test service is local
    s = Service()
    yield s
    s.close()


def test_http_scores_in_order_in_batches_with_bounded_concurrency(service):
    service.delay = 0.2
    responses = [str(10 ** i) for i in range(10)]  # lengths 1..10
    got = HttpReward(service.url, batch_size=3, concurrency=2)(_samples(responses))
    assert [g["score"] for g in got] == list(range(1, 11))
    assert sorted(service.batch_sizes) == [1, 3, 3, 3]
    assert 1 < service.max_inflight <= 2


def test_http_scores_weights_and_components_in_the_reward(service):
    cfg = RewardConfig(functions=["hpcrl.rewards:exact_match"],
                       http=RewardHttpConfig(url=service.url, weight=2.0))
    sources, weights = scoring.load_sources(cfg)
    table = scoring.score(_rollouts(RESPONSES), sources, weights)
    lengths = [len(r) for r in RESPONSES]
    assert table["reward"].to_pylist() == [1.0 + 2 * 2, 2 * 4, 2 * 1, 2 * 26, 2 * 12]
    comps = [dict(c) for c in table["reward_components"].to_pylist()]
    assert [c["http"] for c in comps] == lengths and [c["http/digits"] for c in comps] == [1, 1, 1, 0, 0]
    assert table["reward_message"].to_pylist()[3] == "http: long"
    service.mode = "plain"
    assert HttpReward(service.url)(_samples()) == [float(n) for n in lengths]


def test_http_retries_a_service_that_is_warming_up(service):
    service.mode, service.failures = "flaky", 2
    got = HttpReward(service.url, retries=2, backoff_s=0.01)(_samples())
    assert [g["score"] for g in got] == [len(r) for r in RESPONSES] and len(service.batch_sizes) == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_service_down_is_named_with_its_url():
    url = f"http://127.0.0.1:{_free_port()}/score"
    with pytest.raises(RewardBackendError) as err:
        HttpReward(url, retries=1, backoff_s=0.01)(_samples())
    msg = str(err.value)
    assert msg.startswith(f"reward service {url}: batch 1 of 1 (5 samples): "
                          "cannot reach the service (ConnectError")
    assert msg.endswith("gave up after 2 attempts")


def test_http_timeout_is_named_with_its_url(service):
    """The service never answers while the client waits: only the client's own timeout can end
    the call (a missing timeout hangs here until pytest's)."""
    service.mode = "slow"
    with pytest.raises(RewardBackendError) as err:
        HttpReward(service.url, timeout_s=0.2, retries=0)(_samples())
    assert not service.release.is_set() and service.batch_sizes == [5]  # it gave up on a pending request
    assert str(err.value) == (f"reward service {service.url}: batch 1 of 1 (5 samples): no answer within "
                              "timeout_s = 0.2 s (ReadTimeout); gave up after 1 attempt")


def test_http_a_trickling_answer_ends_at_the_deadline_and_a_huge_one_is_refused(service):
    """Pins: timeout_s per read rather than per request (an answer trickled a byte at a time never
    trips a read timeout), and answers read whatever their size."""
    service.mode = "trickle"
    t0 = time.monotonic()
    with pytest.raises(RewardBackendError, match=r"no answer within timeout_s = 0.5 s \(ReadTimeout\)"):
        HttpReward(service.url, timeout_s=0.5, retries=0)(_samples())
    assert time.monotonic() - t0 < 5  # the whole answer takes about 10 s at this pace
    service.mode = "huge"
    with pytest.raises(RewardBackendError, match=r"the answer is larger than 2000 bytes \(not retried\)"):
        HttpReward(service.url, retries=3, max_body_bytes=2000)(_samples())
    assert service.batch_sizes[-1:] == [5] and len(service.batch_sizes) == 2
    assert len(HttpReward(service.url)(_samples())) == 5  # the same answer under the default cap


@pytest.mark.parametrize("mode, expected", [
    ("bad_json", "the answer is not JSON (Expecting property name enclosed in double quotes"),
    ("wrong_count", "expected 5 scores (one per sample), got 4"),
    ("nan", "scores[0]: expected a finite number, got 'NaN'"),
    ("http400", "HTTP 400: '{\"error\": \"no\"}' (not retried)"),
])
def test_http_answers_that_break_the_protocol_fail_at_once(service, mode, expected):
    service.mode = mode
    with pytest.raises(RewardBackendError) as err:
        HttpReward(service.url, retries=3, backoff_s=0.01)(_samples())
    assert str(err.value).startswith(f"reward service {service.url}: batch 1 of 1 (5 samples): ")
    assert expected in str(err.value)
    assert service.batch_sizes == [5]  # not retried


# ---------------------------------------------------------------- the score stage


def _rollouts(responses: list[str]):
    import pyarrow as pa

    n = len(responses)
    return pa.table({
        "split": ["train"] * n, "prompt_index": [0] * n, "sample_index": list(range(n)),
        "data_source": ["tiny"] * n, "prompt_text": [PROMPT] * n, "ground_truth": ["46"] * n,
        "response_text": responses, "response_ids": [[1]] * n, "finish_reason": ["stop"] * n})


def _run_with_generate(root: Path, reward: dict):
    """A run directory whose iteration 0 has committed (synthetic) rollouts, with `reward` in its config."""
    exp = synthetic_run.write_config(root, 1, group_size=4, prompts_per_iteration=4, max_tokens=8)
    exp = config.with_overrides(exp, {f"reward.{k}": v for k, v in reward.items()}, "test")
    run = RunDir.at(root)
    run.config_path.write_text(config.dumps(exp))
    rollouts = synthetic_run.rollouts_table(0, 16, 4, group_size=4, max_tokens=8)
    synthetic_run.commit_generate(run, exp, 0, rollouts, np.random.default_rng(0))
    return run, rollouts


def test_score_stage_commits_nothing_when_the_service_is_down(tmp_path):
    from stages import score

    url = f"http://127.0.0.1:{_free_port()}/score"
    run, _ = _run_with_generate(tmp_path / "r", {"http": {"url": url, "retries": 1, "backoff_s": 0.01}})
    with pytest.raises(RewardBackendError, match=f"reward service {url}: .*cannot reach the service"):
        score.main(["--run-dir", str(run.root), "--iteration", "0"])
    assert not commit.is_committed(run.stage_dir(0, "score")) and not run.stage_dir(0, "score").exists()


def test_score_stage_combines_functions_reward_model_and_service(tmp_path, classifier, service):
    from stages import score

    run, rollouts = _run_with_generate(tmp_path / "r", {
        "model": {"path": str(classifier), "weight": 0.5, "batch_size": 4},
        "http": {"url": service.url, "weight": -0.1, "batch_size": 8}})
    score.main(["--run-dir", str(run.root), "--iteration", "0"])
    manifest = commit.read_manifest(run.stage_dir(0, "score"))
    table = commit.read_table(run.stage_dir(0, "score"), "scores")
    assert sorted(service.batch_sizes) == [4, 8, 8]  # 16 training + 4 validation samples
    texts = rollouts["response_text"].to_pylist()
    model = _direct(classifier,
                    [p + r for p, r in zip(rollouts["prompt_text"].to_pylist(), texts, strict=True)])
    exact = [float(r == g) for r, g in zip(texts, rollouts["ground_truth"].to_pylist(), strict=True)]
    expected = [e + 0.5 * m - 0.1 * len(r) for e, m, r in zip(exact, model, texts, strict=True)]
    assert table["reward"].to_pylist() == pytest.approx(expected, abs=1e-5)
    comps = dict(table["reward_components"].to_pylist()[0])
    assert set(comps) == {"hpcrl.rewards:exact_match", "hpcrl.rewards:exact_match/nonempty", "model", "http",
                          "http/digits", "truncated"}
    metrics = manifest["metrics"]
    assert metrics["reward/model/mean"] == pytest.approx(np.mean(model[:16]), abs=1e-5)
    assert metrics["reward/http/mean"] == pytest.approx(np.mean([len(r) for r in texts[:16]]))
    assert metrics["reward/hpcrl.rewards:exact_match/mean"] == pytest.approx(np.mean(exact[:16]))


def test_metric_names_of_components_are_ones_mlflow_accepts():
    assert scoring.metric_name("hpcrl.rewards:gsm8k/format") == "hpcrl.rewards:gsm8k/format"
    assert scoring.metric_name("http/a b?/../") == "http/a_b_/_/_"
    assert rewards.merge({"a": 1.0, "b": {"score": 2.0, "x": 3.0, "message": "m"}}, {"a": 0.5, "b": 2.0}) == \
        rewards.Scored(4.5, {"a": 1.0, "b": 2.0, "b/x": 3.0}, "b: m")
