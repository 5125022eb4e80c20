"""Reward backends beyond rule functions: a reward model and an HTTP reward service.

Both are reward sources (hpcrl/rewards.py): called once per score job with every sample of the
iteration, they return one output per sample, in order. They never return a partial result: a
backend that cannot score raises RewardBackendError naming the model directory or the URL and
what happened, so the score stage commits nothing. Weighting and combining the outputs is
`rewards.merge`'s job, not theirs.

HTTP reward protocol: the samples go in batches of `batch_size`, several in flight at once,
    POST <url>   {"samples": [{"prompt": str, "response": str, "ground_truth": str, "data_source": str}, ...]}
and a 2xx answer carries one score per sample, in order:
    {"scores": [<number> | {"score": <number>, "<component>": <number>, ..., "message": <str>}, ...]}
A request that cannot connect, times out or gets HTTP 408, 429 or 5xx is retried with exponential
backoff; any other status, or an answer that breaks the protocol (not JSON, the wrong number of
scores, a non-finite score), fails at once.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config import RewardHttpConfig, RewardModelConfig
from hpcrl.rewards import Output

if TYPE_CHECKING:
    import httpx
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RewardBackendError(RuntimeError):
    """A reward backend could not score; the message names the model or the URL and what happened."""


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _excerpt(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------- reward model


def inspect_model(path: str) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The config and tokenizer of a reward model directory, checked without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    where = f"reward model {path}"
    if not (Path(path) / "config.json").is_file():
        raise RewardBackendError(f"{where}: not an HF model directory (no config.json)")
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise RewardBackendError(f"{where}: cannot load its config: {_first_line(err)}") from None
    archs = cfg.architectures or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardBackendError(f"{where}: architectures {archs} is not a sequence-classification model "
                                 "(expected one AutoModelForSequenceClassification loads, e.g. "
                                 "Qwen2ForSequenceClassification)")
    if cfg.num_labels != 1:
        raise RewardBackendError(f"{where}: num_labels = {cfg.num_labels}; expected 1 (one score per sample)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise RewardBackendError(f"{where}: cannot load a tokenizer: {_first_line(err)}") from None
    if pad_token_id(cfg, tok) is None:
        raise RewardBackendError(f"{where}: no pad token: expected pad_token_id in config.json or a pad "
                                 "token in the tokenizer, to score batches")
    return cfg, tok


def pad_token_id(cfg: PretrainedConfig, tok: PreTrainedTokenizerBase) -> int | None:
    """The id the model treats as padding (its config's), else the tokenizer's pad token."""
    configured = getattr(cfg.get_text_config(), "pad_token_id", None)
    return configured if configured is not None else tok.pad_token_id


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RewardBackendError("reward.model.device = 'cuda' but this score job sees no GPU")
    return device


def pad_batch(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask: real tokens keep the positions they have alone."""
    import torch

    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        input_ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[j, : len(r)] = 1
    return input_ids, mask


class RewardModel:
    """An HF sequence-classification model (num_labels = 1), loaded once: a sample's score is its
    logit on `prompt + response` (the prompt as the policy saw it), tokenized as one text and cut
    to its last `max_length` tokens (at most the model's max_position_embeddings). Samples are
    scored in batches of similar length."""

    def __init__(self, cfg: RewardModelConfig):
        import torch
        from transformers import AutoModelForSequenceClassification

        model_cfg, self.tokenizer = inspect_model(cfg.path)
        self.path, self.batch_size = cfg.path, cfg.batch_size
        positions = getattr(model_cfg.get_text_config(), "max_position_embeddings", None)
        self.max_length = min(cfg.max_length, positions or cfg.max_length)
        self.device = resolve_device(cfg.device)
        dtype = "auto" if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=dtype)
        except (OSError, ValueError) as err:
            raise RewardBackendError(f"reward model {cfg.path}: cannot load the weights: "
                                     f"{_first_line(err)}") from None
        self.pad_id = pad_token_id(model_cfg, self.tokenizer)
        model.config.get_text_config().pad_token_id = self.pad_id  # the padding pad_batch writes
        self.model = model.to(self.device).eval()
        self.tokenizer.truncation_side = "left"  # keep the response, lose the start of the prompt

    def __call__(self, samples: list[dict]) -> list[Output]:
        import torch

        if not samples:
            return []
        texts = [(s["prompt"] or "") + (s["response"] or "") for s in samples]
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                input_ids, mask = pad_batch([ids[i] for i in batch], self.pad_id)
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=mask.to(self.device)).logits
                for i, value in zip(batch, logits[:, 0].float().tolist(), strict=True):
                    scores[i] = value
        bad = [i for i, v in enumerate(scores) if not math.isfinite(v)]
        if bad:
            raise RewardBackendError(f"reward model {self.path}: non-finite score for {len(bad)} of "
                                     f"{len(scores)} samples (the first is sample {bad[0]})")
        return scores


# ---------------------------------------------------------------- HTTP reward service


def _finite_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_output(out, i: int) -> Output:
    if isinstance(out, dict):
        wrong = [k for k, v in out.items()
                 if not (_finite_number(v) or (k == "message" and isinstance(v, str)))]
        if "score" not in out or wrong:
            raise ValueError(f"scores[{i}]: expected a finite number or an object with a numeric `score`, "
                             f"numeric components and a string `message`, got {_excerpt(json.dumps(out))}")
        return out
    if not _finite_number(out):
        raise ValueError(f"scores[{i}]: expected a finite number, got {_excerpt(json.dumps(out))}")
    return float(out)


def parse_scores(text: str, n: int) -> list[Output]:
    """The scores of a service answer to a batch of n samples; ValueError says how it breaks the protocol."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the answer is not JSON ({err}): {_excerpt(text)}") from None
    if not isinstance(body, dict) or not isinstance(body.get("scores"), list):
        raise ValueError(f'expected a JSON object {{"scores": [...]}}, got {_excerpt(text)}')
    if len(body["scores"]) != n:
        raise ValueError(f"expected {n} scores (one per sample), got {len(body['scores'])}")
    return [_check_output(out, i) for i, out in enumerate(body["scores"])]


@dataclass(frozen=True)
class HttpReward:
    """Scores samples with a user's service over HTTP (the protocol above), `concurrency` batches at once."""

    url: str
    batch_size: int = 32
    concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    max_body_bytes: int = 16 << 20

    @classmethod
    def from_config(cls, cfg: RewardHttpConfig) -> HttpReward:
        return cls(cfg.url, cfg.batch_size, cfg.concurrency, cfg.timeout_s, cfg.retries, cfg.backoff_s,
                   int(cfg.max_body_mb * (1 << 20)))

    def __call__(self, samples: list[dict]) -> list[Output]:
        import httpx

        batches = [samples[i : i + self.batch_size] for i in range(0, len(samples), self.batch_size)]
        failed = threading.Event()  # stops the other batches' retries once one batch has failed
        limits = httpx.Limits(max_connections=self.concurrency)
        with (httpx.Client(timeout=self.timeout_s, limits=limits) as client,
              ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward-http") as pool):
            futures = [pool.submit(self._score_batch, client, b, k, len(batches), failed)
                       for k, b in enumerate(batches)]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
                if errors:
                    raise errors[0]
                return [out for f in futures for out in f.result()]
            finally:
                failed.set()
                for f in futures:
                    f.cancel()

    def _score_batch(self, client: httpx.Client, batch: list[dict], k: int, n: int,
                     failed: threading.Event) -> list[Output]:
        import httpx

        where = f"reward service {self.url}: batch {k + 1} of {n} ({len(batch)} samples)"
        problem = ""
        for attempt in range(self.retries + 1):
            if failed.is_set() or (attempt and failed.wait(self.backoff_s * 2 ** (attempt - 1))):
                raise RewardBackendError(f"{where}: abandoned after another batch failed")
            try:
                status, text = self._post(client, batch)
            except httpx.TimeoutException as err:
                problem = f"no answer within timeout_s = {self.timeout_s:g} s ({type(err).__name__})"
                continue
            except httpx.TransportError as err:
                problem = f"cannot reach the service ({type(err).__name__}: {_first_line(err)})"
                continue
            except ValueError as err:  # too large
                raise RewardBackendError(f"{where}: {err} (not retried)") from None
            if status in RETRY_STATUS:
                problem = f"HTTP {status}: {_excerpt(text)}"
                continue
            if not 200 <= status < 300:
                raise RewardBackendError(f"{where}: HTTP {status}: {_excerpt(text)} (not retried)")
            try:
                return parse_scores(text, len(batch))
            except ValueError as err:
                raise RewardBackendError(f"{where}: {err}") from None
        attempts = f"{self.retries + 1} attempt" + ("s" if self.retries else "")
        raise RewardBackendError(f"{where}: {problem}; gave up after {attempts}")

    def _post(self, client: httpx.Client, batch: list[dict]) -> tuple[int, str]:
        """(status, body) of one request: over once timeout_s has passed since it began, however the
        server trickles its answer, and refused beyond max_body_bytes."""
        import httpx

        deadline = time.monotonic() + self.timeout_s
        with client.stream("POST", self.url, json={"samples": batch}) as resp:
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise ValueError(f"the answer is larger than {self.max_body_bytes} bytes")
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the answer did not complete in time")
            return resp.status_code, body.decode(resp.encoding or "utf-8", errors="replace")
