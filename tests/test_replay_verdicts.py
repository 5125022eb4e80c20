"""Replay verdicts on outputs that really differ: one token, one logprob, one reward, one weight.

Each test commits an original stage output and a replayed one that differs from it in exactly
one place (through hpcrl.commit, like the stages), and checks that `replay.compare` says
"DIFFERENT" and names what differs, and that a difference within tolerance is still a match.
Then the verdicts' edges (other sample or step counts, tolerances at exactly their value, files
and metrics on one side only, the report's text), and what a replay reads and how it runs
(`needs`, `prepare`, `run_stage`) on a small synthetic run, with a stand-in for the executor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file, save_file

from hpcrl import commit, config, executors, pruning, replay
from hpcrl.rundir import RunDir
from tests import synthetic_run


def _commit(stage_dir, tables: dict[str, pa.Table], policy: dict[str, torch.Tensor] | None = None):
    writer = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    for name, table in tables.items():
        writer.write_table(name, table)
    if policy is not None:
        (writer.dir / "policy").mkdir()
        save_file(policy, str(writer.dir / "policy" / "model.safetensors"))
    commit.commit(stage_dir, writer, {"stage": stage_dir.name})
    return stage_dir


def _verdict(original, replayed, stage) -> tuple[replay.Report, str]:
    report = replay.compare(original, replayed, stage)
    return report, replay.format_report(report, original, replayed, {})


@pytest.fixture
def rollouts() -> pa.Table:
    return synthetic_run.rollouts_table(0, n_train=16, n_val=4, group_size=4, max_tokens=8)


def _with_row(table: pa.Table, column: str, row: int, change) -> pa.Table:
    values = table[column].to_pylist()
    values[row] = change(values[row])
    return table.set_column(table.schema.get_field_index(column), column,
                            pa.array(values, table.schema.field(column).type))


def _first_nonempty(table: pa.Table) -> int:
    return next(i for i, ids in enumerate(table["response_ids"].to_pylist()) if ids)


def _name(table: pa.Table, row: int) -> str:
    r = table.slice(row, 1).to_pylist()[0]
    return f"{r['split']} prompt {r['prompt_index']} sample {r['sample_index']}"


def test_generate_replay_of_identical_rollouts_is_byte_identical(tmp_path, rollouts):
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": rollouts})
    report, text = _verdict(a, b, "generate")
    assert report.identical and report.match and text.endswith("verdict: MATCH: byte-identical")
    assert f"token agreement: {rollouts.num_rows}/{rollouts.num_rows} samples identical" in text


def test_one_other_token_makes_a_generate_replay_differ_and_names_the_sample(tmp_path, rollouts):
    """Pins: a generate verdict that ignores token agreement (it compared logprobs only on the
    samples whose tokens agree, so one changed token left nothing to compare)."""
    row = _first_nonempty(rollouts)
    changed = _with_row(rollouts, "response_ids", row, lambda ids: [ids[0] + 1, *ids[1:]])
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": changed})
    report, text = _verdict(a, b, "generate")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    n = rollouts.num_rows
    assert f"token agreement: {n - 1}/{n} samples identical" in text
    assert f"first sample with other tokens: {_name(rollouts, row)}" in text


@pytest.mark.parametrize("shift, match", [(5e-3, False), (1e-5, True)])
def test_generate_logprobs_are_judged_against_the_tolerance(tmp_path, rollouts, shift, match):
    """Pins: the logprob tolerance (1e-3) dropped or inverted. Same tokens, one logprob moved by
    more than the tolerance: different, naming the sample; moved by less: a match."""
    row = _first_nonempty(rollouts)
    changed = _with_row(rollouts, "logprobs", row, lambda lp: [lp[0] + shift, *lp[1:]])
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": changed})
    report, text = _verdict(a, b, "generate")
    assert not report.identical and report.match is match
    assert text.endswith("verdict: MATCH within tolerance" if match else "verdict: DIFFERENT")
    assert ("logprobs beyond the tolerance 1e-03: worst at " + _name(rollouts, row) in text) is not match


def test_one_other_reward_makes_a_score_replay_differ_and_names_the_sample(tmp_path, rollouts):
    rewards = synthetic_run.exact_match_rewards(rollouts)
    original = synthetic_run.scores_table(rollouts, rewards.copy())  # the table shares a numpy array's memory
    rewards[3] = 1.0 - rewards[3]
    a = _commit(tmp_path / "a" / "score", {"scores": original})
    b = _commit(tmp_path / "b" / "score", {"scores": synthetic_run.scores_table(rollouts, rewards)})
    report, text = _verdict(a, b, "score")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    n = rollouts.num_rows
    assert "differing files: scores.parquet" in text and f"scores: {n - 1}/{n} samples identical" in text
    assert (f"first sample scored differently: {_name(rollouts, 3)}: "
            f"reward {1.0 - rewards[3]} -> {rewards[3]}") in text


def _stats(losses: list[float]) -> pa.Table:
    return pa.table({"step": pa.array(range(len(losses)), pa.int32()), "loss": losses})


@pytest.fixture
def policy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(16, 8, generator=g),
            "layers.0.mlp.weight": torch.randn(8, 8, generator=g)}


def _commit_update(root, policy, losses):
    writer = commit.StageWriter(commit.fresh_temp_dir(root / "update"))
    writer.tables["stats"] = {"file": "stats.parquet", "rows": len(losses), "schema": "stats"}
    import pyarrow.parquet as pq

    pq.write_table(_stats(losses), writer.dir / "stats.parquet")
    (writer.dir / "policy").mkdir()
    save_file(policy, str(writer.dir / "policy" / "model.safetensors"))
    commit.commit(root / "update", writer, {"stage": "update"})
    return root / "update"


@pytest.mark.parametrize("shift, match", [(1e-3, False), (5e-7, True)])
def test_one_weight_beyond_the_tolerance_makes_an_update_replay_differ_and_names_the_tensor(
        tmp_path, policy, shift, match):
    """Pins: an update verdict that ignores the weight tolerance (always a match), or one that
    demands bit-identity. One weight moved by 1e-3 is different and the tensor is named; by
    5e-7 (float32 noise at this scale) it is a match within tolerance."""
    a = _commit_update(tmp_path / "a", policy, [0.5, 0.25])
    moved = {k: v.clone() for k, v in policy.items()}
    moved["layers.0.mlp.weight"][2, 3] += shift
    b = _commit_update(tmp_path / "b", moved, [0.5, 0.25])
    assert load_file(b / "policy" / "model.safetensors")["layers.0.mlp.weight"][2, 3] != policy[
        "layers.0.mlp.weight"][2, 3]
    report, text = _verdict(a, b, "update")
    assert not report.identical and report.match is match
    assert text.endswith("verdict: MATCH within tolerance" if match else "verdict: DIFFERENT")
    assert "(in layers.0.mlp.weight)" in text
    assert ("beyond the weight tolerance 1e-06: 1 of 2 tensors" in text) is not match


@pytest.mark.parametrize("loss, match", [(0.125, False), (0.25 + 1e-9, True)])
def test_an_update_replay_with_other_losses_differs_and_says_so(tmp_path, policy, loss, match):
    """Same weights, one step's loss different beyond the tolerance: different (the update did
    not compute what it committed); within float noise: a match."""
    a = _commit_update(tmp_path / "a", policy, [0.5, 0.25])
    b = _commit_update(tmp_path / "b", policy, [0.5, loss])
    report, text = _verdict(a, b, "update")
    assert report.match is match
    assert f"per-step loss: max difference {abs(loss - 0.25):.2e}" in text
    assert ("per-step loss beyond the tolerance 1e-06" in text) is not match


# What a replay reads, and how it runs: `needs`, `prepare` and `run_stage` on a small synthetic run
# (tests/synthetic_run.py commits every stage through hpcrl.commit, without vLLM or DeepSpeed).


@pytest.fixture
def small_run(tmp_path):
    """A committed 2-iteration run (generate, score, update x 2 + final validation), each update with
    a policy/ folder, and its frozen experiment."""
    policy = tmp_path / "weights"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"not really weights")
    run = synthetic_run.make_run(tmp_path / "runs" / "r", iterations=2, rows=8, val_rows=2, group_size=4,
                                 policy_from=policy)
    return run, config.load(run.config_path)


def _tree(root) -> dict[str, str]:
    """{path under root: 'dir' or 'link -> target'} of everything a replay directory holds but files."""
    return {str(p.relative_to(root)): f"link -> {p.readlink()}" if p.is_symlink() else "dir"
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_dir()}


def test_a_replay_needs_the_policy_it_samples_with_and_the_update_state_it_starts_from(small_run):
    """Pins `needs`: generate reads the policy version it sampled with (plan.policy_version, not
    the iteration: with max_staleness 1, iteration 1 sampled with version 0); an update reads its
    starting policy and trainer state (version k) and the policy it made (k + 1); score reads no
    weights."""
    _, exp = small_run
    assert replay.needs(exp, "generate", 1) == [(1, "policy")]
    assert replay.needs(exp, "update", 1) == [(1, "policy"), (1, "trainer"), (2, "policy")]
    assert replay.needs(exp, "update", 0) == [(0, "policy"), (0, "trainer"), (1, "policy")]
    assert replay.needs(exp, "score", 1) == []
    stale = config.with_overrides(exp, {"algorithm.max_staleness": 1}, "test")
    assert replay.needs(stale, "generate", 1) == [(0, "policy")]
    assert replay.needs(stale, "generate", 2) == [(2, "policy")]  # the final iteration: the final policy


@pytest.mark.parametrize("stage, links", [
    ("score", {"iter_000001/generate": (1, "generate")}),
    ("update", {"iter_000001/generate": (1, "generate"), "iter_000001/score": (1, "score"),
                "iter_000000/update": (0, "update")}),
    ("generate", {"iter_000000/update": (0, "update")}),
])
def test_prepare_links_exactly_the_committed_inputs_and_writes_the_config(small_run, tmp_path, stage, links):
    """Pins `prepare`'s replay directory: the frozen config under the replay header, and one
    symbolic link per input of the stage (plan.inputs) to the original's committed output, nothing
    else (no link to the replayed stage itself, which the replay writes; no other iteration)."""
    run, exp = small_run
    before = {p: p.read_bytes() for p in sorted(run.root.rglob(commit.MANIFEST))}
    out = tmp_path / "replays" / "deep" / "one"  # parents that do not exist yet
    replayed, replay_exp = replay.prepare(run, exp, 1, stage, {}, out)
    assert replayed == RunDir.at(out) and replay_exp is exp
    assert replayed.config_path.read_text() == ("# Replay config (written by hpcrl replay).\n"
                                                + config.dumps(exp))
    expected = {str(Path(name).parent): "dir" for name in links}
    expected.update({name: f"link -> {run.stage_dir(*source)}" for name, source in links.items()})
    assert _tree(out) == expected
    assert not replayed.stage_dir(1, stage).exists()
    assert {p: p.read_bytes() for p in sorted(run.root.rglob(commit.MANIFEST))} == before  # only read


def test_prepare_applies_the_overrides_to_the_replay_only(small_run, tmp_path):
    """Pins: `--set` overrides reach the replay's config (and the returned experiment), never the
    run's; an unknown key is refused naming `--set`."""
    run, exp = small_run
    frozen = run.config_path.read_text()
    replayed, replay_exp = replay.prepare(run, exp, 1, "score", {"update.lr": 0.125}, tmp_path / "o")
    assert replay_exp.update.lr == 0.125 and exp.update.lr != 0.125
    assert config.load(replayed.config_path).update.lr == 0.125
    assert run.config_path.read_text() == frozen
    with pytest.raises(config.ConfigError, match=r"^--set: invalid config:\n  update\.nope: unknown key"):
        replay.prepare(run, exp, 1, "score", {"update.nope": 1}, tmp_path / "o2")


def test_prepare_without_out_makes_a_new_directory_under_the_runs_root(small_run):
    """Pins the default replay directory: <runs_root>/replays/<run name>/iter_<k>-<stage>-<time>."""
    run, exp = small_run
    replayed, _ = replay.prepare(run, exp, 1, "score", {})
    assert replayed.root.parent == run.root.parent / "replays" / run.root.name
    assert re.fullmatch(r"iter_000001-score-\d{8}-\d{6}", replayed.root.name)
    assert (replayed.root / "iter_000001" / "generate").is_symlink()


def test_prepare_refuses_a_non_empty_out_and_takes_an_empty_one(small_run, tmp_path):
    """Pins: a replay never writes into a directory that holds something (an earlier replay),
    and an existing empty directory is fine."""
    run, exp = small_run
    full, empty = tmp_path / "full", tmp_path / "empty"
    full.mkdir()
    (full / "old.txt").write_text("an earlier replay")
    empty.mkdir()
    with pytest.raises(FileExistsError, match=rf"^{re.escape(str(full))}: exists and is not empty; "
                                              "choose another --out$"):
        replay.prepare(run, exp, 1, "score", {}, full)
    assert sorted(p.name for p in full.iterdir()) == ["old.txt"]
    replayed, _ = replay.prepare(run, exp, 1, "score", {}, empty)
    assert (replayed.root / "iter_000001" / "generate").is_symlink()


def test_prepare_refuses_a_stage_that_is_not_committed(small_run, tmp_path):
    """Pins: there is nothing to replay in a stage without a manifest (iteration 2 of a 2-iteration
    run has no update)."""
    run, exp = small_run
    with pytest.raises(commit.CorruptOutputError,
                       match=rf"^{re.escape(str(run.stage_dir(2, 'update')))}: not committed; "
                             "there is nothing to replay$"):
        replay.prepare(run, exp, 2, "update", {}, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("stage, damaged", [
    ("score", (1, "generate")),   # an input
    ("update", (0, "update")),    # an input from the previous iteration
    ("update", (1, "update")),    # the stage itself (the replay compares with it)
])
def test_prepare_refuses_a_corrupted_input_or_original_naming_every_problem(small_run, tmp_path, stage,
                                                                            damaged):
    """Pins: every input of the stage, and the original output itself, is verified against its
    manifest before anything is written; all the problems are named, joined by '; '."""
    run, exp = small_run
    source = run.stage_dir(*damaged)
    files = sorted(source.glob("*.parquet"))
    for f in files:
        _flip(f)
    expected = "; ".join(f"{f}: checksum mismatch with {commit.MANIFEST}" for f in files)
    with pytest.raises(commit.CorruptOutputError) as err:
        replay.prepare(run, exp, 1, stage, {}, tmp_path / "o")
    assert str(err.value) == expected
    assert not (tmp_path / "o").exists()


def test_prepare_refuses_weights_that_retention_pruned(small_run, tmp_path):
    """Pins: a replay that needs a pruned policy version or trainer state is refused in one line
    that says which replay and which version; a replay that needs neither still runs."""
    run, exp = small_run
    made_1 = run.stage_dir(0, "update")  # made policy version 1 and its trainer state
    (made_1 / commit.PRUNED).write_text(json.dumps({"trainer": {"at": "then", "rule": "by hand"}}))
    with pytest.raises(commit.PrunedError, match=r"^replay of update of iteration 1: the trainer state of "
                                                 r"version 1 was pruned by retention \(by hand, at then\)"):
        replay.prepare(run, exp, 1, "update", {}, tmp_path / "t1")
    replay.prepare(run, exp, 0, "update", {}, tmp_path / "t0")  # starts from the base model's
    replay.prepare(run, exp, 1, "generate", {}, tmp_path / "t2")  # reads the policy only
    (made_1 / commit.PRUNED).unlink()

    kept_one = config.with_overrides(exp, {"run.retention.keep_last": 1}, "test")
    assert [(e["version"], e["part"]) for e in pruning.prune(run, kept_one)] == [(1, "policy")]
    for stage, iteration in [("update", 1), ("update", 0), ("generate", 1)]:
        with pytest.raises(commit.PrunedError,
                           match=rf"^replay of {stage} of iteration {iteration}: the policy version 1 was "
                                 "pruned by retention"):
            replay.prepare(run, exp, iteration, stage, {}, tmp_path / f"{stage}{iteration}")
        assert not (tmp_path / f"{stage}{iteration}").exists()
    replay.prepare(run, exp, 0, "generate", {}, tmp_path / "g0")  # the base model
    replay.prepare(run, exp, 1, "score", {}, tmp_path / "s1")
    replay.prepare(run, exp, 2, "generate", {}, tmp_path / "g2")  # version 2: kept


# The verdicts' edges: other sample counts, nothing to compare, files and metrics on one side only,
# tolerances at exactly their value, and the report's text.


def _commit_with(stage_dir, tables: dict[str, pa.Table], metrics: dict[str, float] | None = None,
                 extra_files: tuple[str, ...] = ()):
    """Like _commit, with the stage's metrics and some extra (non-table) files in the output."""
    writer = commit.StageWriter(commit.fresh_temp_dir(stage_dir))
    for name, table in tables.items():
        writer.write_table(name, table)
    for name in extra_files:
        (writer.dir / name).write_text(name)
    writer.metrics.update(metrics or {})
    commit.commit(stage_dir, writer, {"stage": stage_dir.name})
    return stage_dir


@pytest.mark.parametrize("stage", ["generate", "score"])
def test_a_replay_with_another_number_of_samples_differs(tmp_path, rollouts, stage):
    """Pins: a replay that produced one sample less is different, and says how many each has
    (a verdict that returned 'match' on a count mismatch would pass whatever the replay made)."""
    tables = {"rollouts": rollouts} if stage == "generate" else {
        "scores": synthetic_run.scores_table(rollouts, synthetic_run.exact_match_rewards(rollouts))}
    name = next(iter(tables))
    a = _commit(tmp_path / "a" / stage, tables)
    b = _commit(tmp_path / "b" / stage, {name: tables[name].slice(0, rollouts.num_rows - 1)})
    report, text = _verdict(a, b, stage)
    n = rollouts.num_rows
    assert not report.match and text.endswith("verdict: DIFFERENT")
    assert f"samples: {n} in the original, {n - 1} in the replay" in text.splitlines()


def test_a_generate_replay_where_no_sample_agrees_differs_with_nothing_to_compare(tmp_path, rollouts):
    """Pins the generate verdict when no sample's tokens agree, so no logprob can be compared: the
    logprob difference is 0 (not a crash on an empty max or mean, nor a made-up 1.0), and the
    verdict is different because of the tokens."""
    nonempty = rollouts.filter(pc.greater(pc.list_value_length(rollouts["response_ids"]), 0))
    other = nonempty.set_column(
        nonempty.schema.get_field_index("response_ids"), "response_ids",
        pa.array([[t + 1 for t in ids] for ids in nonempty["response_ids"].to_pylist()],
                 nonempty.schema.field("response_ids").type))
    a = _commit(tmp_path / "a" / "generate", {"rollouts": nonempty})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": other})
    report, text = _verdict(a, b, "generate")
    m = nonempty.num_rows
    assert m > 1 and not report.match and text.endswith("verdict: DIFFERENT")
    lines = text.splitlines()
    assert f"token agreement: 0/{m} samples identical (0.0%)" in lines
    assert "logprob difference on identical samples: max 0.00e+00, mean 0.00e+00" in lines
    assert f"first sample with other tokens: {_name(nonempty, 0)}" in lines
    assert not any(line.startswith("logprobs beyond") for line in lines)


def test_token_agreement_is_a_share_of_the_samples(tmp_path, rollouts):
    """Pins the share printed after the count: 19 of 20 is 95.0%, and one sample of one is 100.0%
    (the max(n, 1) guards an empty table, it does not halve a single sample)."""
    row = _first_nonempty(rollouts)
    changed = _with_row(rollouts, "response_ids", row, lambda ids: [ids[0] + 1, *ids[1:]])
    a = _commit(tmp_path / "a" / "generate", {"rollouts": rollouts})
    b = _commit(tmp_path / "b" / "generate", {"rollouts": changed})
    assert rollouts.num_rows == 20
    assert "token agreement: 19/20 samples identical (95.0%)" in _verdict(a, b, "generate")[1].splitlines()
    one = rollouts.slice(row, 1)
    a1 = _commit(tmp_path / "a1" / "generate", {"rollouts": one})
    b1 = _commit(tmp_path / "b1" / "generate", {"rollouts": one})
    report, text = _verdict(a1, b1, "generate")
    assert report.identical and "token agreement: 1/1 samples identical (100.0%)" in text.splitlines()
    assert "files: byte-identical (1 files checked)" in text.splitlines()


def test_compare_names_the_differing_files_on_either_side_and_the_first_eight(tmp_path, rollouts):
    """Pins the file comparison: a file only the original has, or only the replay has, is a
    differing file; a file both have with the same bytes (rollouts.parquet) is not; the first
    eight are named in order. With the same rollouts the numbers still match."""
    extra = tuple(f"z{i:02d}.txt" for i in range(9))
    a = _commit_with(tmp_path / "a" / "generate", {"rollouts": rollouts}, extra_files=("a_only.txt",))
    b = _commit_with(tmp_path / "b" / "generate", {"rollouts": rollouts}, extra_files=extra)
    report, text = _verdict(a, b, "generate")
    assert not report.identical and report.match and text.endswith("verdict: MATCH within tolerance")
    lines = text.splitlines()
    assert "files: different (2 files checked)" in lines
    assert "differing files: " + ", ".join(("a_only.txt", *extra[:7])) in lines


def test_compare_reports_the_metrics_of_either_side(tmp_path, rollouts):
    """Pins the metrics table: every metric either output recorded, sorted, with None where one
    side lacks it, and the replay's value from the replay's manifest."""
    a = _commit_with(tmp_path / "a" / "generate", {"rollouts": rollouts},
                     {"response_length/mean": 5.0, "perf/throughput": 100.0, "only/original": 1.5})
    b = _commit_with(tmp_path / "b" / "generate", {"rollouts": rollouts},
                     {"response_length/mean": 5.0, "perf/throughput": 120.0, "only/replay": 2.0})
    report, text = _verdict(a, b, "generate")
    assert report.metrics == [("only/original", 1.5, None), ("only/replay", None, 2.0),
                              ("perf/throughput", 100.0, 120.0), ("response_length/mean", 5.0, 5.0)]
    assert report.identical and report.match  # the metrics are reported, never judged


def test_format_report_lays_out_overrides_lines_metrics_and_verdict():
    """Pins the report's text: the overrides as key=repr(value), the comparison's lines, then one
    row per metric (value, '-' where a side lacks it, the delta replay - original only where both
    have it, speed metrics marked), then the verdict."""
    report = replay.Report(identical=False, match=False, lines=["files: different (2 files checked)",
                                                                "scores: 3/4 samples identical"],
                           metrics=[("actor/loss", 0.5, 0.25), ("only/original", 1.5, None),
                                    ("only/replay", None, 2.0), ("perf/throughput", 100.0, 120.0)])
    text = replay.format_report(report, Path("/runs/r/iter_000001/score"), Path("/out/iter_000001/score"),
                                {"reward.functions": ["hpcrl.rewards:gsm8k"], "update.lr": 0.125})
    assert text == "\n".join([
        "original: /runs/r/iter_000001/score",
        "replay:   /out/iter_000001/score",
        "overrides: reward.functions=['hpcrl.rewards:gsm8k'], update.lr=0.125",
        "files: different (2 files checked)",
        "scores: 3/4 samples identical",
        "metric                               original       replay        delta",
        "actor/loss                                0.5         0.25        -0.25",
        "only/original                             1.5            -             ",
        "only/replay                                 -            2             ",
        "perf/throughput                           100          120          +20  (speed)",
        "verdict: DIFFERENT"])
    plain = replay.format_report(replay.Report(True, True), Path("o"), Path("r"), {})
    header = "metric                               original       replay        delta"
    assert plain.splitlines()[2:] == [header, "verdict: MATCH: byte-identical"]


def test_an_update_replay_with_other_tensor_names_differs_and_names_them(tmp_path, policy):
    """Pins: tensors on one side only make the update different, and the first four names of
    either side are shown, sorted (not the names both have)."""
    a = _commit_update(tmp_path / "a", {**policy, "a.only": torch.zeros(2)}, [0.5])
    b = _commit_update(tmp_path / "b", {**policy, **{f"b.{i}": torch.zeros(2) for i in range(4)}}, [0.5])
    report, text = _verdict(a, b, "update")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    assert "policy weights: tensors differ in name: ['a.only', 'b.0', 'b.1', 'b.2']" in text.splitlines()


def test_an_update_replay_with_a_tensor_of_another_shape_differs_and_names_it(tmp_path, policy):
    """Pins: a tensor of another shape is an infinite difference (not broadcast, not a crash), and
    the worst tensor named is the one that differs most, not the last name."""
    a = _commit_update(tmp_path / "a", policy, [0.5])
    b = _commit_update(tmp_path / "b", {**policy, "embed.weight": policy["embed.weight"][:, :4].clone()},
                       [0.5])
    report, text = _verdict(a, b, "update")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    lines = text.splitlines()
    assert "policy weights: max difference inf (in embed.weight)" in lines
    assert "beyond the weight tolerance 1e-06: 1 of 2 tensors" in lines


def test_the_update_names_the_tensor_that_differs_most(tmp_path, policy):
    """Pins the worst tensor's name: 'embed.weight' moved by 1e-2 and 'layers.0.mlp.weight' by
    1e-3 name 'embed.weight' (a max over the names would name the other)."""
    moved = {k: v.clone() for k, v in policy.items()}
    moved["embed.weight"][0, 0] += 1e-2
    moved["layers.0.mlp.weight"][0, 0] += 1e-3
    a = _commit_update(tmp_path / "a", policy, [0.5])
    b = _commit_update(tmp_path / "b", moved, [0.5])
    report, text = _verdict(a, b, "update")
    assert not report.match
    assert "(in embed.weight)" in text and "beyond the weight tolerance 1e-06: 2 of 2 tensors" in text


@pytest.mark.parametrize("what", ["weight", "loss"])
def test_a_difference_of_exactly_the_tolerance_is_beyond_it(tmp_path, what):
    """Pins the update's bounds: a weight (float64 checkpoint) or a step's loss that differs by
    exactly WEIGHT_TOL or LOSS_TOL (1e-6, exact in float64 from 0) is different, and counted."""
    weights = {"w": torch.zeros(3, dtype=torch.float64), "v": torch.zeros(3, dtype=torch.float64)}
    moved = {k: v.clone() for k, v in weights.items()}
    if what == "weight":
        moved["w"][1] = 1e-6
    a = _commit_update(tmp_path / "a", weights, [0.0, 0.5])
    b = _commit_update(tmp_path / "b", moved, [1e-6 if what == "loss" else 0.0, 0.5])
    report, text = _verdict(a, b, "update")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    lines = text.splitlines()
    assert ("beyond the weight tolerance 1e-06: 1 of 2 tensors" in lines) is (what == "weight")
    assert ("per-step loss beyond the tolerance 1e-06 (2 and 2 steps)" in lines) is (what == "loss")


def test_an_update_replay_that_made_no_step_compares_the_weights_only(tmp_path, policy):
    """Pins the loss comparison of updates without an optimizer step: no loss difference (0, not a
    crash on an empty max, nor a made-up 1.0), so equal weights match."""
    a = _commit_update(tmp_path / "a", policy, [])
    b = _commit_update(tmp_path / "b", {k: v.clone() for k, v in policy.items()}, [])
    report, text = _verdict(a, b, "update")
    assert report.match and "per-step loss: max difference 0.00e+00" in text.splitlines()


def test_an_update_replay_with_another_number_of_steps_differs(tmp_path, policy):
    """Pins a bug fixed here: a replayed update that made another number of optimizer steps (a
    replay with `--set update.mini_batches=3`) crashed with a traceback (the per-step loss zip was
    strict) instead of the verdict; now it is different and says both counts."""
    a = _commit_update(tmp_path / "a", policy, [0.5, 0.25])
    b = _commit_update(tmp_path / "b", policy, [0.5, 0.25, 0.125])
    report, text = _verdict(a, b, "update")
    assert not report.match and text.endswith("verdict: DIFFERENT")
    assert "per-step loss: max difference 0.00e+00" in text.splitlines()
    assert "per-step loss beyond the tolerance 1e-06 (2 and 3 steps)" in text.splitlines()


class _FakeJob:
    """A finished submitit job: its exception and its log files."""

    def __init__(self, error, logs):
        self.error = error
        self.paths = SimpleNamespace(stdout=str(logs / "0_log.out"), stderr=str(logs / "0_log.err"))

    def exception(self):
        return self.error


@pytest.mark.parametrize("error, commits", [(None, True), (None, False), (RuntimeError("boom"), True)])
def test_run_stage_runs_the_stage_locally_and_fails_when_it_did_not_commit(small_run, tmp_path, monkeypatch,
                                                                            error, commits):
    """Pins `run_stage`: the stage of that iteration runs once through the local executor on the
    replay directory with the replay's experiment; it succeeds only when the job ended without an
    error and committed its output, else RuntimeError names the stage, the job's stderr log and
    its last lines (a job that crashed after committing still failed)."""
    run, exp = small_run
    replayed, replay_exp = replay.prepare(run, exp, 1, "score", {}, tmp_path / "o")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "0_log.err").write_text("starting\nTraceback: the reward function failed\n")
    calls = []

    class FakeExecutor:
        def __init__(self, on, with_exp):
            calls.append(("executor", on, with_exp))

        def submit(self, stage, iteration):
            calls.append(("submit", stage, iteration))
            if commits:
                _commit(replayed.stage_dir(iteration, stage), {"scores": synthetic_run.scores_table(
                    rollouts_1, synthetic_run.exact_match_rewards(rollouts_1))})
            return executors.StageJob(_FakeJob(error, logs), stage, iteration)

    rollouts_1 = commit.read_table(run.stage_dir(1, "generate"), "rollouts")
    monkeypatch.setattr(executors, "LocalExecutor", FakeExecutor)
    if error is None and commits:
        assert replay.run_stage(replayed, replay_exp, 1, "score") is None
    else:
        with pytest.raises(RuntimeError) as err:
            replay.run_stage(replayed, replay_exp, 1, "score")
        assert str(err.value) == (f"the replayed score stage failed (log {logs / '0_log.err'}):\n"
                                  "starting\nTraceback: the reward function failed")
    assert calls == [("executor", replayed, replay_exp), ("submit", "score", 1)]
