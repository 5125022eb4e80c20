"""hpcrl.critic, fast: the value model on a tiny random Qwen2, the Critic's steps on a stand-in for
DeepSpeed's engine (stage 0, one rank, SGD), saving and loading, and GAE targets, each against
values, losses and gradients worked out here from the backbone's hidden states (or numpy)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM  # imported once (mutmut forks after collecting)

from hpcrl import batches, critic, sequence_parallel, trainer
from hpcrl.config import AlgorithmConfig
from hpcrl.config_training import UpdateConfig

PROMPTS = [[1, 2], [3, 4, 5], [6, 7], [1, 2], [8, 9, 10, 11]]
RESPONSES = [[4, 5, 6], [7], [8, 9, 10, 11], [12, 13], [14, 15]]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    """A tiny causal LM's directory, as a policy's is (the value model's backbone comes from it): its
    config and safetensors weights (not save_pretrained, which imports DeepSpeed: seconds per test run)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    out = tmp_path_factory.mktemp("policy")
    cfg.save_pretrained(out)
    save_file(Qwen2ForCausalLM(cfg).state_dict(), str(out / "model.safetensors"))
    return out


def random_head(model: critic.ValueModel, seed: int = 1) -> critic.ValueModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=g))
        model.value_head.bias.fill_(0.25)
    return model


def by_hand(model: critic.ValueModel, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The values of the response tokens (float64): w . h + b of the backbone's hidden state at the
    position before each token, the row run alone."""
    h = model.backbone(input_ids=torch.tensor([prompt + response])).last_hidden_state[0].double()
    v = h @ model.value_head.weight[0].double() + model.value_head.bias[0].double()
    return v[len(prompt) - 1: len(prompt) - 1 + len(response)]


def samples() -> batches.Samples:
    return batches.Samples(keys=None, prompt_ids=PROMPTS, response_ids=RESPONSES, sampler_logprobs=[],
                           rewards=torch.zeros(len(PROMPTS)), group_ids=torch.arange(len(PROMPTS)))


def test_the_value_model_reads_its_head_off_the_backbones_last_hidden_states(policy_dir):
    model = random_head(critic.load_value_model(policy_dir, torch.float32))
    assert (model.value_head.in_features, model.value_head.out_features) == (16, 1)
    ids = torch.tensor([[0, 0, 3, 4, 5], [6, 7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, mask)
        h = model.backbone(input_ids=ids, attention_mask=mask).last_hidden_state.numpy().astype(np.float64)
        unmasked = model(ids, torch.ones_like(mask)).values
    w, b = model.value_head.weight.detach().numpy()[0], model.value_head.bias.item()
    assert out.values.shape == (2, 5) and out.values.dtype == torch.float32
    np.testing.assert_allclose(out.values.numpy(), h @ w + b, rtol=1e-5, atol=1e-5)
    assert out.past_key_values is None  # no cache unless asked for
    assert not torch.allclose(unmasked[0, 2:], out.values[0, 2:], atol=1e-4)  # the mask reaches the backbone
    torch.testing.assert_close(unmasked[1], out.values[1])
    with torch.no_grad():
        one = model(ids[1:], mask[1:])  # one row: still [1, tokens]
        cached = model(ids[1:, :3], mask[1:, :3], use_cache=True)
        rest = model(ids[1:, 3:], mask[1:], past_key_values=cached.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[3, 4]]))
    assert one.values.shape == (1, 5)
    assert cached.past_key_values.get_seq_length() == 5  # the prefix's cache, extended by `rest`
    torch.testing.assert_close(torch.cat([cached.values, rest.values], 1), one.values, atol=1e-5, rtol=1e-4)


def test_a_bfloat16_value_model_gives_float32_values(policy_dir):
    model = random_head(critic.load_value_model(policy_dir, torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long)).values
    assert out.dtype == torch.float32 and out.shape == (1, 3) and out.abs().sum() > 0


def test_a_policy_becomes_a_value_model_with_a_zero_head(policy_dir):
    model = critic.load_value_model(policy_dir, torch.float32)
    assert model.value_head.weight.abs().sum() == 0 and model.value_head.bias.abs().sum() == 0
    weights = load_file(policy_dir / "model.safetensors")
    own = model.backbone.state_dict()
    assert weights.keys() >= {f"model.{k}" for k in own} and len(own) > 10
    for name, tensor in own.items():  # the policy's backbone, as saved
        assert torch.equal(tensor, weights[f"model.{name}"]), name
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long))
    assert out.values.tolist() == [[0.0] * 3]


class Engine:
    """What the Critic asks of a DeepSpeed engine, as DeepSpeed does it at ZeRO stage 0 on one rank:
    each backward divides the loss by gradient_accumulation_steps, the optimizer (here SGD) steps
    at the accumulation boundary (every `accum` micro-batches, or where it was told)."""

    def __init__(self, model, lr: float, accum: int):
        self.module, self.accum, self.micro, self.told, self.steps = model, accum, 0, None, 0
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        self.device, self.log = torch.device("cpu"), []

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def gradient_accumulation_steps(self) -> int:
        return self.accum

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        self.told = last

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.told if self.told is not None else (self.micro + 1) % self.accum == 0

    def zero_optimization_stage(self) -> int:
        return 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.steps += 1
        self.micro += 1

    def save_checkpoint(self, directory: str, tag: str, exclude_frozen_parameters: bool) -> None:
        self.log.append(("save_checkpoint", directory, tag, exclude_frozen_parameters))

    def _zero3_consolidated_16bit_state_dict(self) -> dict:
        self.log.append("zero3")
        return self.gathered  # under ZeRO-3 the module's own parameters are each rank's partitions


def experiment(dtype: str = "float32", clip: float = 0.05, agg: str = "token-mean", **update):
    return SimpleNamespace(model=SimpleNamespace(dtype=dtype),
                           update=UpdateConfig(**{"micro_batch_size": 2, "share_prompts": False, **update}),
                           algorithm=AlgorithmConfig(name="ppo", group_size=1, loss_agg=agg,
                                                     critic={"lr": 0.5, "value_clip": clip}))


def make_critic(monkeypatch, policy_dir, exp, rank: int = 0, world_size: int = 1, grad_accum: int = 2,
                state_dir: Path | None = None, sp_group=None):
    made = []

    def make_engine(model, lr, exp_, world_size_, grad_accum_, state_dir_, what):
        made.append((lr, exp_, world_size_, grad_accum_, state_dir_, what))
        return Engine(model, lr, grad_accum_)

    monkeypatch.setattr(trainer, "make_engine", make_engine)
    c = critic.Critic(exp, rank, world_size, policy_dir, state_dir, grad_accum, pad_id=0, sp_group=sp_group)
    random_head(c.engine.module)
    return c, made


def test_the_critic_builds_its_engine_from_the_config(monkeypatch, policy_dir, tmp_path):
    exp = experiment(dtype="bfloat16", gradient_checkpointing=True)
    c, made = make_critic(monkeypatch, policy_dir, exp, rank=1, world_size=2, grad_accum=3,
                          state_dir=tmp_path / "state")
    assert made == [(0.5, exp, 2, 3, tmp_path / "state", "critic")]
    assert (c.exp, c.rank, c.world_size, c.pad_id) == (exp, 1, 2, 0)
    assert c.engine.module.backbone.is_gradient_checkpointing
    assert {p.dtype for p in c.engine.module.parameters()} == {torch.bfloat16}
    plain, _ = make_critic(monkeypatch, policy_dir, experiment())
    assert not plain.engine.module.backbone.is_gradient_checkpointing
    assert {p.dtype for p in plain.engine.module.parameters()} == {torch.float32}


def test_values_of_are_the_values_before_each_response_token(monkeypatch, policy_dir):
    for update in ({}, {"share_prompts": True}, {"max_tokens_per_micro_batch": 9}):
        c, _ = make_critic(monkeypatch, policy_dir, experiment(**update))
        got = c.values_of(samples(), [3, 0, 4])  # rows 3 and 0 share their prompt
        assert sorted(got) == [0, 3, 4], update
        for i, values in got.items():
            with torch.no_grad():
                expected = by_hand(c.engine.module, PROMPTS[i], RESPONSES[i]).tolist()
            assert values == pytest.approx(expected, abs=1e-5), (update, i)


def step_by_hand(model, mini, old, ret, clip: float, agg: str, lr: float):
    """The loss, clip fraction, gradient norm and SGD-stepped weights of one critic step, from the
    rows run alone: 0.5 * max((V - R)^2, (V_old + clamp(V - V_old, +-clip) - R)^2), token mean over
    the mini-batch (or the mean over rows of each row's token mean)."""
    model = copy.deepcopy(model)
    errs, clipped = [], 0
    for i in mini:
        v = by_hand(model, PROMPTS[i], RESPONSES[i])
        o, r = torch.tensor(old[i], dtype=torch.float64), torch.tensor(ret[i], dtype=torch.float64)
        plain, moved = (v - r) ** 2, (o + (v - o).clamp(-clip, clip) - r) ** 2
        errs.append(torch.maximum(plain, moved))
        clipped += int((((v - o).abs() > clip) & (moved > plain)).sum())
    n = sum(len(RESPONSES[i]) for i in mini)
    loss = 0.5 * (sum(e.sum() for e in errs) / n if agg == "token-mean" else
                  sum(e.mean() for e in errs) / len(mini))
    loss.backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters()}
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads.values())))
    stepped = {name: p.detach().double() - lr * grads[name] for name, p in model.named_parameters()}
    return loss.item(), clipped / n, norm, stepped


def check_step(c: critic.Critic, agg: str) -> None:
    """One train_step of `c` on 4 rows against `step_by_hand`."""
    mini = [3, 0, 2, 1]  # 2 micro-batches of 2 rows (5 and 5 tokens), or 3 packed ones of at most 9
    rng = np.random.default_rng(2)
    with torch.no_grad():
        now = {i: by_hand(c.engine.module, PROMPTS[i], RESPONSES[i]).tolist() for i in mini}
    old = {i: (np.array(v) + rng.normal(0, 0.2, len(v))).tolist() for i, v in now.items()}
    ret = {i: rng.normal(0, 1, len(v)).tolist() for i, v in now.items()}
    loss, clipfrac, norm, stepped = step_by_hand(c.engine.module, mini, old, ret, 0.05, agg, 0.5)
    assert 0.2 < clipfrac < 0.8  # the case tells clipped tokens from the others
    stats = c.train_step(samples(), mini, old, ret)
    assert c.engine.steps == 1 and c.engine.module.training
    assert stats.keys() == {"vf_loss", "vf_clipfrac", "vf_grad_norm"}
    assert stats["vf_loss"] == pytest.approx(loss, rel=1e-5)
    assert stats["vf_clipfrac"] == pytest.approx(clipfrac, abs=1e-6)  # float32 per micro-batch
    assert stats["vf_grad_norm"] == pytest.approx(norm, rel=1e-4)
    for name, p in c.engine.module.named_parameters():
        torch.testing.assert_close(p.detach().double(), stepped[name], atol=2e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("agg", "update"), [("token-mean", {}), ("seq-mean-token-mean", {}),
                                             ("token-mean", {"max_tokens_per_micro_batch": 9})])
def test_a_critic_step_is_one_sgd_step_on_the_clipped_value_loss(monkeypatch, policy_dir, agg, update):
    c, _ = make_critic(monkeypatch, policy_dir, experiment(agg=agg, **update))
    check_step(c, agg)


def test_a_sequence_parallel_critic_counts_its_groups_sums_once(monkeypatch, policy_dir):
    """update.sequence_parallel = 2, rank 0 of one group of 2 ranks: the values come from
    hpcrl.sequence_parallel (stood in for by the whole rows' values, which the group's slices
    gather to), and both ranks add the same sums (all_sum stood in for by twice them)."""
    group, seen = object(), []

    def sp_values(model, mb, g):
        seen.append((model, g, mb.index.tolist()))
        return batches.response_outputs(model, mb, "values")

    monkeypatch.setattr(sequence_parallel, "values", sp_values)
    monkeypatch.setattr(trainer, "all_sum", lambda values: [2 * v for v in values])
    c, _ = make_critic(monkeypatch, policy_dir, experiment(sequence_parallel=2, world_size=2), world_size=2,
                       sp_group=group)
    check_step(c, "token-mean")
    assert seen == [(c.engine, group, [3, 0]), (c.engine, group, [2, 1])]


def test_a_non_finite_critic_loss_stops_the_update(monkeypatch, policy_dir):
    c, _ = make_critic(monkeypatch, policy_dir, experiment())
    before = copy.deepcopy(c.engine.module.state_dict())
    old = {i: [0.0] * len(RESPONSES[i]) for i in range(4)}
    ret = {**old, 2: [0.0, float("nan"), 0.0, 0.0]}
    with pytest.raises(FloatingPointError) as err:
        c.train_step(samples(), [0, 1, 2, 3], old, ret)
    assert str(err.value) == ("non-finite critic loss (nan) on rank 0; the update is not committed and the "
                              "run stays at the last good version")
    assert c.engine.steps == 0
    assert all(torch.equal(t, before[k]) for k, t in c.engine.module.state_dict().items())


def test_a_saved_critic_loads_as_it_was(monkeypatch, policy_dir, tmp_path):
    c, _ = make_critic(monkeypatch, policy_dir, experiment())
    with torch.no_grad():
        for p in c.engine.module.parameters():  # no longer the policy's weights
            p.add_(torch.randn_like(p) * 0.01)
    out, state = tmp_path / "critic", tmp_path / "trainer" / "critic"
    out.mkdir()
    c.save(out, state)
    assert c.engine.log == [("save_checkpoint", str(state), "state", False)]
    assert sorted(load_file(out / critic.HEAD_FILE)) == ["bias", "weight"]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    loaded = critic.load_value_model(out, torch.float32)
    mine = c.engine.module.state_dict()
    assert loaded.state_dict().keys() == mine.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mine[name]), name


def test_only_rank_0_writes_and_zero3_gathers_on_every_rank(monkeypatch, policy_dir, tmp_path):
    other, _ = make_critic(monkeypatch, policy_dir, experiment(), rank=1, world_size=2)
    other.save(tmp_path / "a", tmp_path / "state_a")
    assert not (tmp_path / "a").exists()
    assert other.engine.log == [("save_checkpoint", str(tmp_path / "state_a"), "state", False)]
    for rank in (1, 0):
        c, _ = make_critic(monkeypatch, policy_dir, experiment(zero_stage=3), rank=rank, world_size=2)
        # the weights gathered from every rank's partition; the module's own are not them
        c.engine.gathered = {k: t + 1 for k, t in c.engine.module.state_dict().items()}
        out = tmp_path / f"z{rank}"
        out.mkdir()
        c.save(out, tmp_path / "state")
        assert c.engine.log == ["zero3", ("save_checkpoint", str(tmp_path / "state"), "state", False)]
        assert (out / critic.HEAD_FILE).is_file() == (rank == 0)
    loaded = critic.load_value_model(out, torch.float32).state_dict()  # rank 0's: the gathered weights
    assert loaded.keys() == c.engine.gathered.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, c.engine.gathered[name]), name


def gae_by_hand(outcome, mask, values, kl, coef, gamma, lam):
    """numpy: token rewards (-coef * kl on each response token, the outcome on the last), then GAE
    backwards over each row's response tokens, the value after the last one 0."""
    rewards = np.where(mask > 0, -coef * kl, 0.0)
    adv = np.zeros_like(rewards)
    for b in range(len(mask)):
        n = int(mask[b].sum())
        if n:
            rewards[b, n - 1] += outcome[b]
        last = 0.0
        for t in reversed(range(n)):
            nxt = values[b, t + 1] if t + 1 < n else 0.0
            last = rewards[b, t] + gamma * nxt - values[b, t] + gamma * lam * last
            adv[b, t] = last
    return rewards, adv, adv + values * mask


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_targets_by_hand(whiten):
    rng = np.random.default_rng(5)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=np.float64)
    values, kl = rng.normal(size=(4, 4)) * mask, rng.normal(size=(4, 4))
    outcome = np.array([1.0, -0.5, 2.0, 0.75])
    algo = AlgorithmConfig(name="ppo", group_size=1, norm_adv_by_std=whiten,
                           critic={"gamma": 0.9, "lam": 0.7})
    v32 = torch.tensor(values, dtype=torch.float32)
    t = critic.gae_targets(torch.tensor(outcome), torch.tensor(mask), v32, torch.tensor(kl), 0.3, algo)
    rewards, adv, ret = gae_by_hand(outcome, mask, v32.double().numpy(), kl, 0.3, 0.9, 0.7)
    if whiten:  # over the 7 response tokens: (x - mean) / unbiased std
        x = adv[mask > 0]
        adv = np.where(mask > 0, (adv - x.mean()) / x.std(ddof=1), 0.0)
    np.testing.assert_allclose(t.rewards.numpy(), rewards, atol=1e-12)
    np.testing.assert_allclose(t.returns.numpy(), ret, atol=1e-6)
    np.testing.assert_allclose(t.advantages.numpy(), adv, atol=1e-6)
    assert t.advantages.dtype == torch.float64
