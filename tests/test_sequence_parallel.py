"""Ulysses sequence parallelism in the update (hpcrl.sequence_parallel, `update.sequence_parallel`):
two ranks splitting each sequence give the one-rank update (real DeepSpeed on gloo), and the
settings it cannot run are refused before any job."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from hpcrl import commit, config, preflight
from hpcrl.config import ConfigError
from hpcrl.sequence_parallel import segment_bounds, segmented, slice_bounds

pytestmark = pytest.mark.timeout(900)


def test_a_sequence_is_padded_to_a_multiple_of_the_ranks_and_cut_in_equal_slices():
    assert [slice_bounds(7, 2, i) for i in range(2)] == [(8, 0, 4), (8, 4, 8)]
    assert [slice_bounds(9, 3, i) for i in range(3)] == [(9, 0, 3), (9, 3, 6), (9, 6, 9)]
    assert slice_bounds(1, 4, 3) == (4, 3, 4)


def test_runs_of_consecutive_positions_bound_the_rows_of_a_pack():
    assert segment_bounds([0, 1, 2, 0, 1, 0, 1, 2, 3]) == [0, 3, 5, 9]
    assert segment_bounds([5, 6, 7]) == [0, 3]
    assert segment_bounds([0, 0, 1]) == [0, 1, 3]


def test_segmented_attention_keeps_each_packed_row_to_itself():
    """Attention over a pack of three rows (positions restarting at 0), against each row run alone
    through torch's causal attention. pins: rows of a pack that see each other (plain causal
    attention over the whole pack), or a segment cut one token off."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    lengths, heads, dim = [3, 1, 4], 2, 8
    q, k, v = (torch.randn(1, heads, sum(lengths), dim) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    module = torch.nn.Module()
    out, _ = segmented(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = torch.nn.functional.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part],
                                                                 is_causal=True)
        torch.testing.assert_close(out[:, part], alone.transpose(1, 2))
        start += n
    whole, _ = sdpa_attention_forward(module, q, k, v, None)
    assert not torch.allclose(out, whole)  # without the cut, the rows after the first see the ones before
    again, _ = segmented(sdpa_attention_forward)(module, q, k, v, None, position_ids=torch.arange(8)[None])
    torch.testing.assert_close(again, whole)


def test_two_ranks_splitting_each_sequence_update_the_policy_as_one_rank_does(write_experiment):
    """The update of iteration 0 with update.sequence_parallel = 2 on 2 ranks (one group: both
    ranks run every micro-batch, each its half of each sequence, attention exchanged by DeepSpeed's
    all-to-all) against the same update on one rank, with an entropy bonus so that both gathered
    outputs carry gradients; once with padded rows, once packed (rows end to end up to 40 tokens)
    with gradient checkpointing. pins: a gradient counted once per rank of the group (twice the
    step), a gather whose backward drops the other rank's loss (half the gradient of each slice),
    rows split over ranks instead of groups, statistics counted twice, slices that see each
    other's padding, or packed rows that see each other (no segmented attention)."""
    from tests.test_update_deepspeed import _run_update, _weights

    algorithm = {"entropy_coef": 0.01}
    common = dict(share_prompts=False, zero_stage=2, lr=1e-3)
    one = _run_update(write_experiment, "sp-one", algorithm=algorithm, world_size=1, **common)
    two = _run_update(write_experiment, "sp-two", algorithm=algorithm, world_size=2, sequence_parallel=2,
                      **common)
    packed = _run_update(write_experiment, "sp-packed", algorithm=algorithm, world_size=2,
                         sequence_parallel=2, max_tokens_per_micro_batch=40, gradient_checkpointing=True,
                         **common)
    lr = common["lr"]
    before = load_file(config.load(one.config_path).model.path + "/model.safetensors")
    w1 = _weights(one)
    assert max((w1[k] - before[k]).abs().max().item() for k in before) > lr
    for run in (two, packed):
        stats = [commit.read_table(r.stage_dir(0, "update"), "stats").to_pylist() for r in (run, one)]
        assert len(stats[0]) == len(stats[1]) == 2  # update.mini_batches
        for a, b in zip(*stats, strict=True):
            for key in ("loss", "pg_loss", "entropy", "pg_clipfrac", "ppo_kl"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (run.root.name, key)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
            assert a["tokens"] == b["tokens"]
        # Adam divides by the gradient's own scale: where a gradient is near 0, rounding moves a
        # weight by a visible fraction of lr (2.2% of it on one CPU, depending on its kernels); a
        # wrong gradient (a slice's sign or share) moves most weights by about lr
        w = _weights(run)
        diffs = [(w[k] - w1[k]).abs() for k in w1]
        assert max(d.max().item() for d in diffs) < 0.25 * lr
        assert sum(d.sum().item() for d in diffs) / sum(d.numel() for d in diffs) < 1e-4 * lr


@pytest.mark.parametrize(("update", "algorithm", "message"), [
    ({"world_size": 3, "sequence_parallel": 2, "share_prompts": False},
     {}, r"update\.sequence_parallel: 2 ranks per sequence must divide update\.world_size = 3"),
    ({"world_size": 2, "sequence_parallel": 2}, {},
     r"update\.sequence_parallel: .*expected share_prompts = false"),
    ({"world_size": 8, "sequence_parallel": 8, "share_prompts": False, "micro_batch_size": 2}, {},
     r"update\.sequence_parallel: 8 ranks must divide the attention heads of .* \(4 query, 4 key/value"),
], ids=["world", "shared-prompts", "heads"])
def test_what_sequence_parallelism_cannot_run_is_refused_before_any_job(write_experiment, update, algorithm,
                                                                         message):
    path = write_experiment(update=update, algorithm=algorithm)
    with pytest.raises(ConfigError, match=message):
        preflight.check(config.load(path), str(path))


def test_a_critic_whose_attention_differs_from_the_policys_is_refused(write_experiment, tiny_task, tmp_path):
    """The value model's attention goes through the one registration made for the policy's heads.
    pins: a critic of other heads reaching the update (DeepSpeed's all-to-all asserting mid-job)."""
    import json
    import shutil

    critic = tmp_path / "critic"
    shutil.copytree(tiny_task / "model", critic)
    cfg = json.loads((critic / "config.json").read_text())
    cfg["num_attention_heads"] *= 2
    (critic / "config.json").write_text(json.dumps(cfg))
    update = {"world_size": 2, "sequence_parallel": 2, "share_prompts": False}
    path = write_experiment(update=update, algorithm={"name": "ppo", "critic": {"path": str(critic)}})
    with pytest.raises(ConfigError, match=r"update\.sequence_parallel: the critic .* must have the same "
                                          r"attention heads"):
        preflight.check(config.load(path), str(path))
    same = {"name": "ppo", "critic": {"path": str(tiny_task / "model")}}
    path = write_experiment(update=update, algorithm=same)
    preflight.check(config.load(path), str(path))  # the policy's own shape passes


def test_sequence_parallel_batches_split_rows_over_groups(write_experiment):
    """pins: the batch-shape check counting every rank as taking rows of its own."""
    from hpcrl import trainer

    exp = config.load(write_experiment(update={"world_size": 4, "sequence_parallel": 2,
                                               "share_prompts": False, "mini_batches": 2}))
    trainer.check_batch_shape(exp.update, 12, 4)  # 2 mini-batches over 2 groups: 3 rows each
    with pytest.raises(ValueError, match=r"over 2 groups of update\.sequence_parallel=2 ranks"):
        trainer.check_batch_shape(exp.update, 10, 4)
    from tests.test_batches import _samples

    samples, mini = _samples(50), list(range(8))
    rows = [[mb.index.tolist() for mb in trainer.step_micro_batches(samples, mini, r, 4, exp.update, 0)]
            for r in range(4)]
    assert rows[0] == rows[1] == [[0, 1, 2, 3]] and rows[2] == rows[3] == [[4, 5, 6, 7]]
    assert trainer.gradient_scale(None, exp.update, 1, 4) == 2  # one rank per group, one micro-batch
