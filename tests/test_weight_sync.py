"""Weight transport between processes: a dedicated gloo group, the shared-memory buffer and the
filesystem fallback deliver the trainer's tensors bit-identical (bucketed or per tensor), each
also through the one transport interface the resident mode uses (hpcrl.transports)."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest
import torch

from hpcrl import transports, weight_sync
from hpcrl.distributed import free_port
from hpcrl.weight_sync import FilesystemSync, ProcessGroupSync, SharedMemorySync, WeightSyncError, make_group


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(300, 64, generator=g),
            "layer.0.qkv": torch.randn(192, 64, generator=g),
            "layer.0.bias": torch.randn(192, generator=g), "steps": torch.arange(7, dtype=torch.int64),
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16)}


def _receiver(port: int, bucket_bytes: int, out) -> None:
    pg, _store = make_group("127.0.0.1", port, 1, 2, timeout_s=60)
    received = dict(ProcessGroupSync(pg, 1, bucket_bytes).receive())
    # raw bytes, not tensors: a tensor put on a queue by an exiting process may not arrive
    out.put({k: (str(v.dtype), list(v.shape), _raw(v)) for k, v in received.items()})


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("bucket_bytes", [0, 4096, 64 << 20])
def test_process_group_delivers_bit_identical_tensors(bucket_bytes):
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, bucket_bytes, out))
    proc.start()
    pg, _store = make_group("127.0.0.1", port, 0, 2, timeout_s=60)
    state = _state()
    sent = ProcessGroupSync(pg, 0, bucket_bytes).send(state.items())
    got = out.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert sent == sum(t.numel() * t.element_size() for t in state.values())
    assert list(got) == list(state)  # the sender's order
    for name, t in state.items():
        dtype, shape, raw = got[name]
        assert dtype == str(t.dtype) and shape == list(t.shape) and raw == _raw(t), name  # bit-identical


def test_filesystem_fallback_round_trip(tmp_path):
    state = _state()
    sync = FilesystemSync(tmp_path)
    sync.send(state.items())
    got = dict(sync.receive())
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def test_a_missing_peer_times_out_instead_of_hanging():
    with pytest.raises(Exception, match="(?i)timed out|timeout"):
        make_group("127.0.0.1", free_port(), 0, 2, timeout_s=2)


def _shared_receiver(path: str, header: list, ready, again, out) -> None:
    buffer = SharedMemorySync.map(path, header)
    first = {k: (str(v.dtype), list(v.shape), _raw(v)) for k, v in SharedMemorySync.receive(buffer, header)}
    ready.put("read")  # only now may the sender rewrite the buffer
    again.get(timeout=60)  # the sender rewrote the buffer in place
    second = {k: _raw(v) for k, v in SharedMemorySync.receive(buffer, header)}
    out.put((first, second))


def test_shared_memory_delivers_bit_identical_tensors_in_place():
    state = _state()
    sync = SharedMemorySync()
    nbytes, header, _ = sync.send(state.items())
    assert nbytes == sum(t.numel() * t.element_size() for t in state.values())
    assert sync.path.startswith("/proc/")  # a memfd: nothing in /dev/shm or on disk to leak
    ctx = mp.get_context("spawn")
    ready, again, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_shared_receiver, args=(sync.path, header, ready, again, out))
    proc.start()
    assert ready.get(timeout=60) == "read"
    originals = {name: _raw(t) for name, t in state.items()}
    for t in state.values():
        if t.is_floating_point():
            t.add_(1)
    sync.send(state.items())
    again.put("go")
    first, second = out.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert list(first) == list(state)
    for name, t in state.items():
        # the first send, bit-identical
        assert first[name] == (str(t.dtype), list(t.shape), originals[name]), name
        assert second[name] == _raw(t), name  # the second send, bit-identical
    assert first["embed.weight"][2] != second["embed.weight"]


def test_shared_memory_grows_and_a_receiver_maps_it_again():
    setup = transports.SyncSetup("shared_memory")
    sender, receiver = transports.make(setup), transports.make(setup)
    sender.open_sender()
    small = [("w", torch.full((4,), 1.0))]
    assert dict(receiver.receive(sender.send(small)))["w"].tolist() == [1.0] * 4
    big = [("w", torch.full((4,), 2.0)), ("v", torch.arange(40_000, dtype=torch.float32))]
    got = dict(receiver.receive(sender.send(big)))
    assert got["w"].tolist() == [2.0] * 4 and torch.equal(got["v"], big[1][1])


def test_buckets_read_the_stream_lazily():
    """A sender holds one bucket, never the stream: the checkpoint view gathers and converts a
    layer at a time, and holding them all would hold the whole model twice."""
    pulled = []

    def stream():
        for i in range(10):
            pulled.append(i)
            yield f"t{i}", torch.zeros(256)  # 1 KiB each

    it = weight_sync.buckets(stream(), bucket_bytes=3 * 1024)
    first = next(it)
    assert [n for n, _ in first] == ["t0", "t1", "t2"] and len(pulled) == 4  # one tensor of lookahead
    rest = list(it)
    assert [len(b) for b in rest] == [3, 3, 1] and len(pulled) == 10
    mixed = [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16)), ("c", torch.zeros(2))]
    assert [len(b) for b in weight_sync.buckets(mixed, 1 << 20)] == [1, 1, 1]  # one dtype per bucket
    assert [len(b) for b in weight_sync.buckets(mixed, 1 << 20, same_dtype=False)] == [3]
    assert [len(b) for b in weight_sync.buckets(mixed, 0)] == [1, 1, 1]


def test_filesystem_shards_and_removes_what_an_earlier_sync_left(tmp_path):
    state = _state()
    sync = FilesystemSync(tmp_path, shard_bytes=32 << 10)
    sync.send(state.items())
    assert len(list(tmp_path.glob("weights-*.safetensors"))) > 2
    got = dict(sync.receive())
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())
    FilesystemSync(tmp_path, shard_bytes=1 << 30).send(state.items())
    assert [p.name for p in tmp_path.glob("weights-*")] == ["weights-00000.safetensors"]
    assert set(dict(sync.receive())) == set(state)


def test_auto_transport_is_shared_memory_on_one_cpu_node_else_a_process_group():
    assert transports.choose("auto", "n1", "n1", cuda=False) == "shared_memory"
    assert transports.choose("auto", "n1", "n2", cuda=False) == "process_group"
    assert transports.choose("auto", "n1", "n1", cuda=True) == "process_group"
    assert transports.choose("filesystem", "n1", "n1", cuda=False) == "filesystem"
    with pytest.raises(RuntimeError, match="needs trainer 0 and every engine on one node; trainer 0 is on "
                       "n1, an engine on n2"):
        transports.choose("shared_memory", "n1", "n2", cuda=False)
    assert transports.choose("auto", "n1", ["n1", "n1"], cuda=False) == "shared_memory"  # two engines
    assert transports.choose("auto", "n1", ["n1", "n2"], cuda=False) == "process_group"
    with pytest.raises(RuntimeError, match="an engine on n2"):
        transports.choose("shared_memory", "n1", ["n1", "n2"], cuda=False)


def test_the_sync_group_has_a_rank_per_engine_worker_after_the_trainer():
    layout = transports.SyncLayout(engines=2, tp=2)
    assert layout.world_size == 5
    assert [layout.rank(e, t) for e in range(2) for t in range(2)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no worker 2 of engine 0"):
        layout.rank(0, 2)
    assert transports.SyncSetup("process_group", tp=4).layout.world_size == 5


@pytest.mark.parametrize("name", ["shared_memory", "filesystem"])
def test_each_transport_hands_over_bit_identical_tensors_through_the_interface(name, tmp_path):
    state = _state()
    setup = transports.SyncSetup(name, directory=str(tmp_path / "weights"))
    sender, receiver = transports.make(setup), transports.make(setup.as_dict())  # the worker gets a dict
    sender.open_sender()
    receiver.open_receiver(0, 0)
    for scale in (1, 2):  # the second sync rewrites what the first delivered
        handoff = sender.send((k, v * scale) for k, v in state.items())
        assert (handoff.transport == name
                and handoff.bytes == sum(t.numel() * t.element_size() for t in state.values()))
        got = dict(receiver.receive(transports.Handoff(**handoff.as_dict())))
        assert set(got) == set(state) and all(_raw(got[k]) == _raw(v * scale) for k, v in state.items())
        assert name == "filesystem" or list(got) == list(state)  # safetensors files keep no order
    with pytest.raises(ValueError, match="unknown weight-sync transport 'carrier_pigeon'"):
        transports.make(transports.SyncSetup("carrier_pigeon"))


@pytest.mark.parametrize("name", ["shared_memory", "filesystem"])
def test_a_load_that_a_later_send_overtakes_is_refused(name, tmp_path):
    """The buffer and the directory are rewritten in place by the next send; trainer 0 sends again
    only once every engine has loaded (loaded/<n>, hpcrl.resident_trainer). Were that count wrong,
    an engine would load two versions' weights mixed; each send's stamp makes it fail instead:
    before it reads, while the next send is being written, and after its load (`verify`)."""
    state = _state()
    setup = transports.SyncSetup(name, directory=str(tmp_path / "weights"))
    sender, receiver = transports.make(setup), transports.make(setup.as_dict())
    sender.open_sender()
    receiver.open_receiver(0, 0)
    where = "the shared weight buffer" if name == "shared_memory" else str(tmp_path / "weights")
    first = sender.send(state.items())
    assert set(dict(receiver.receive(first))) == set(state)
    receiver.verify(first)  # the hand-over kept to
    second = sender.send(state.items())
    with pytest.raises(WeightSyncError, match=f"^{where}: .* holds send 2, which is whole, where send 1 was"):
        list(receiver.receive(first))  # overtaken before the engine reads
    reading = receiver.receive(second)
    next(reading)
    third = sender.send(state.items())  # overtaken while the engine reads
    list(reading)
    with pytest.raises(WeightSyncError) as err:
        receiver.verify(second)
    assert str(err.value) == (f"{where}: the weights were rewritten under their reader: it holds send 3, "
                              "which is whole, where send 2 was to be read; the sender must not send again "
                              "before every engine has loaded (loaded/<n>)")

    def overtaking():
        for i, item in enumerate(state.items()):
            if i == 1:  # the next send is half written
                with pytest.raises(WeightSyncError, match="holds send 4, which is being written"):
                    list(receiver.receive(third))
            yield item

    sender.send(overtaking())

    def broken():
        yield next(iter(state.items()))
        raise OSError("trainer 0 died mid-send")

    with pytest.raises(OSError):
        sender.send(broken())
    sixth = sender.send(state.items())  # the interrupted fifth is counted
    assert (first.stamp, second.stamp, sixth.stamp) == (2, 4, 12)
    assert set(dict(receiver.receive(sixth))) == set(state)
    receiver.verify(sixth)


def _tp_receiver(setup: dict, tp_rank: int, out) -> None:
    receiver = transports.make(setup)
    receiver.open_receiver(0, tp_rank)
    got = {k: _raw(v) for k, v in receiver.receive(transports.Handoff("process_group"))}
    receiver.close()  # each end shuts its group down at the end of the run
    out.put((tp_rank, got))


def test_a_process_group_reaches_every_tensor_parallel_worker_of_an_engine():
    """Two workers of one engine (tensor parallel 2) each join the group as their own rank (1, 2)
    and each receive every tensor: a group sized for one receiver would never form."""
    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    setup = transports.SyncSetup("process_group", "127.0.0.1", port, tp=2, timeout_s=60, bucket_bytes=4096)
    procs = [ctx.Process(target=_tp_receiver, args=(setup.as_dict(), t, out)) for t in range(2)]
    for proc in procs:
        proc.start()
    sender = transports.make(setup)
    sender.open_sender(store)
    state = _state()
    sent = sender.send(state.items())
    got = dict(out.get(timeout=60) for _ in procs)
    pg = sender.sync.pg
    sender.close()
    sender.close()  # once is enough
    with pytest.raises(RuntimeError):  # the group is shut down
        pg.broadcast(torch.zeros(1), 0).wait()
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert sent.bytes == sum(t.numel() * t.element_size() for t in state.values())
    for tp_rank in range(2):
        assert got[tp_rank] == {k: _raw(v) for k, v in state.items()}, tp_rank


def _logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    from hpcrl import losses

    with torch.no_grad():
        return [losses.token_logprobs(model(torch.tensor([s])).logits[:, :-1], torch.tensor([s[1:]]),
                                      1.0)[0].tolist()
                for s in sequences]


def test_the_float32_probe_tolerance_catches_weights_delivered_in_bfloat16(tiny_task, tmp_path):
    """Pins: a probe tolerance 100 times looser (1e-2 for float32). A transport that rounds the
    float32 weights to bfloat16 on the way (a realistic bug) serves a policy whose probe
    logprobs move by 3.6e-3 on average (the tiny model): the default float32 tolerance must refuse it, while
    the same weights delivered exactly pass."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tests.conftest as c
    from hpcrl import config, resident_sync
    from hpcrl.weight_sync import WeightSyncError, check_probe, probe_tolerance

    path = tmp_path / "e.toml"
    path.write_text(c.experiment_toml(tiny_task, tmp_path / "runs"))
    exp = config.load(path)
    assert exp.model.dtype == "float32"
    model = AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float32).eval()
    probe = resident_sync.probe_sequences(exp, AutoTokenizer.from_pretrained(tiny_task / "model"))
    trainer = _logprobs(model, probe)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    served = _logprobs(rounded, probe)
    tol = probe_tolerance(0.0, exp.model.dtype)  # executor.resident.sync_check_tol unset
    assert check_probe(_logprobs(copy.deepcopy(model), probe), trainer, trainer, tol,
                       version=1)["sync/logp_diff"] == 0
    with pytest.raises(WeightSyncError, match=r"differ from the trainer's by [0-9.e+-]+ on average, "
                                              r"above the tolerance 1e-04"):
        check_probe(served, trainer, trainer, tol, version=1)


def test_the_16_bit_probe_tolerance_accepts_what_the_trainer_and_vllm_compute_in_bfloat16(tiny_task):
    """Pins the 16-bit tolerance's calibration: the demo's trained model in bfloat16 (trainer
    2.6e-2 from vLLM on average on CPU, tools/calibrate_probe.py) must start, with a margin, while
    float32's tolerance would refuse the same difference."""
    import json
    import subprocess
    import sys

    from hpcrl.weight_sync import probe_tolerance
    from tests.conftest import REPO

    out = subprocess.run([sys.executable, str(REPO / "tools" / "calibrate_probe.py"), "--one",
                          str(tiny_task / "model"), "bfloat16"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe_tolerance(0.0, "float32") < measured["mean"] < probe_tolerance(0.0, "bfloat16") / 2, measured


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_a_non_finite_probe_is_refused(side):
    """Pins: NaN compared against the tolerance (NaN > tol is false, so a NaN policy passed)."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    good, bad = [[-1.0, -2.0]], [[float("nan"), -2.0]]
    engine, trainer = (bad, good) if side == "engine" else (bad, bad)
    with pytest.raises(WeightSyncError, match="not finite"):
        check_probe(engine, trainer, good, 1e-4, version=2)


def test_the_probe_check_returns_its_three_metrics_in_float64():
    """Pins `check_probe`'s sync/* metrics: the engine's mean |difference| from the new weights
    and from the previous ones, and how far the update moved the probe, each under its own name
    and computed in float64 (in float32 a 1e-9 difference next to -1 rounds to 0, and a
    lr-1e-6 update would be invisible)."""
    from hpcrl.weight_sync import check_probe

    new, old = [[-1.0, -2.0], [-3.0 - 1e-9]], [[-1.5, -2.0], [-3.75]]  # 1e-9: lost in float32
    engine = [[-1.0, -2.0 - 1e-9], [-3.0]]
    m = check_probe(engine, new, old, 1e-4, version=3)
    assert set(m) == {"sync/logp_diff", "sync/logp_diff_prev", "sync/update_shift"}
    assert m["sync/logp_diff"] == pytest.approx(2e-9 / 3, rel=1e-6)  # either side's 1e-9 counts
    assert m["sync/logp_diff_prev"] == pytest.approx((0.5 + 1e-9 + 0.75) / 3, rel=1e-12)
    assert m["sync/update_shift"] == pytest.approx((1.25 - 1e-9) / 3, rel=1e-12)
    assert check_probe([], [], [], 1e-4, version=1) == {"sync/logp_diff": 0.0, "sync/logp_diff_prev": 0.0,
                                                       "sync/update_shift": 0.0}  # no probe tokens


def test_a_probe_answer_of_another_shape_is_refused_with_both_shapes():
    """Pins the shape check: an engine answering for fewer probe tokens (a sequence cut short) must
    fail with both shapes, never be compared on what the two have in common."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    with pytest.raises(WeightSyncError, match=r"probe logprobs differ in shape: \(2,\) vs \(3,\)"):
        check_probe([[-1.0], [-2.0]], [[-1.0, -2.0], [-3.0]], [[-1.0, -2.0], [-3.0]], 1e-4, version=1)


def test_the_probe_verdicts_tell_a_sync_that_did_not_happen_from_corrupted_weights():
    """Pins the two failure explanations and the message around them: an engine still on the
    previous weights is told apart from one holding neither (a name or layout read otherwise),
    with the version, the difference, the tolerance and the consequence."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    new, old = [[-1.0, -2.0]], [[-1.5, -2.5]]  # the update moved the probe by 0.5
    stale = (r"^after loading policy version 7, vLLM's logprobs on the probe batch differ from the "
             r"trainer's by 5.00e-01 on average, above the tolerance 1e-02 "
             r"\(executor.resident.sync_check_tol\): it still holds the previous weights \(0.00e\+00 "
             r"from them\): the sync did not happen; stopping rather than training on stale or "
             r"corrupted weights$")
    with pytest.raises(WeightSyncError, match=stale):
        check_probe(old, new, old, 1e-2, version=7)
    neither = (r"^after loading policy version 8, .* by 3.00e\+00 on average, .*: it holds neither the "
               r"new weights nor the previous ones \(2.50e\+00 from those\): weights were loaded but "
               r"differ, as when the engine reads a name, shape or layout otherwise; stopping rather than "
               r"training on stale or corrupted weights$")
    with pytest.raises(WeightSyncError, match=neither):
        check_probe([[-4.0, -5.0]], new, old, 1e-2, version=8)


def test_the_probe_tolerances_are_inclusive():
    """Pins `<=` at each boundary of `check_probe` (values exact in binary): an engine exactly
    `tol` from the new weights passes; one exactly `tol` from the previous weights is 'still on
    the previous weights', not 'neither'; an engine as far from both (diff_old == diff_new) after
    an update beyond the tolerance is a sync that did not take effect, and an update moving the
    probe by exactly the tolerance is not yet 'beyond what the two can tell apart'."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    assert check_probe([[-1.25]], [[-1.0]], [[-1.0]], 0.25, version=1)["sync/logp_diff"] == 0.25
    with pytest.raises(WeightSyncError, match=r"still holds the previous weights \(2.50e-01 from them\)"):
        check_probe([[-1.25]], [[-2.0]], [[-1.0]], 0.25, version=1)
    with pytest.raises(WeightSyncError, match=r"vLLM matches the previous weights \(2.50e-01\) at least as "
                                              r"well as the new ones \(2.50e-01\): the sync did not take "
                                              r"effect$"):
        check_probe([[-1.25]], [[-1.0]], [[-1.5]], 0.25, version=1)  # halfway: shift 0.5 > 0.25
    check_probe([[-1.0]], [[-1.0]], [[-1.25]], 0.25, version=1)  # shift == tol, engine on the new weights
    check_probe([[-1.125]], [[-1.0]], [[-1.25]], 0.25, version=1)  # shift == tol, halfway: not told apart


def test_a_small_update_is_seen_to_arrive_beyond_four_times_the_start_noise():
    """Pins the noise rule: with the start probe's noise measured, an update that moved the probe
    by more than 4 x noise (though less than the tolerance) must reach the engine: an engine
    still on the previous weights fails; by at most 4 x noise (not 5 x, not 4 / noise) it passes,
    as the two cannot tell such an update apart."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    new, old = [[-1.0]], [[-1.0 - 4.5e-3]]  # shift 4.5e-3: above 4 x 1e-3, below tol 1e-2
    with pytest.raises(WeightSyncError, match="did not take effect"):
        check_probe(old, new, old, 1e-2, version=2, noise=1e-3)
    check_probe(old, new, old, 1e-2, version=2)  # noise not measured: the tolerance rules, 4.5e-3 is within
    check_probe(old, [[-1.0]], [[-1.0 - 3.5e-3]], 1e-2, version=2, noise=1e-3)  # 3.5e-3 <= 4e-3: passes
    check_probe(new, new, old, 1e-2, version=2, noise=1e-3)  # the update arrived


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_a_non_finite_probe_names_which_side_is_not_finite(side):
    """Pins the non-finite message's diagnosis: it says whether the trainer's own probe is finite
    (a diverged trainer) or only the engine's is not (a broken load)."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    good, bad = [[-1.0, -2.0]], [[float("inf"), -2.0]]
    trainer = good if side == "engine" else bad
    which = "finite" if side == "engine" else "non-finite"
    with pytest.raises(WeightSyncError, match=rf"^after loading policy version 5, the probe logprobs are not "
                                              rf"finite \(trainer: {which}, difference (nan|inf)\); stopping "
                                              r"rather than serving a non-finite policy$"):
        check_probe(bad, trainer, good, 1e-4, version=5)


def test_probe_tolerance_by_dtype_unless_set():
    """Pins the probe tolerances: `sync_check_tol` when set, else 1e-4 for float32 weights and
    1e-1 for 16-bit ones (tools/calibrate_probe.py)."""
    assert weight_sync.probe_tolerance(0.0, "float32") == 1e-4
    assert weight_sync.probe_tolerance(0.0, "bfloat16") == 1e-1
    assert weight_sync.probe_tolerance(0.0, "float16") == 1e-1
    assert weight_sync.probe_tolerance(3e-3, "float32") == 3e-3


def test_the_sync_layout_refuses_a_worker_outside_it():
    """Pins `SyncLayout.rank`'s bounds on both sides: an engine or tensor-parallel rank past the
    last, or negative, has no rank (it would collide with another worker's, or with trainer 0)."""
    layout = transports.SyncLayout(engines=2, tp=2)
    assert layout.rank(1, 1) == 4 and layout.rank(0, 0) == 1
    for engine, tp_rank in [(2, 0), (0, 2), (-1, 0), (0, -1), (2, 2)]:
        with pytest.raises(ValueError, match=rf"no worker {tp_rank} of engine {engine} in 2 engine\(s\) x 2 "
                                             r"rank\(s\)"):
            layout.rank(engine, tp_rank)


def test_only_shared_memory_is_refused_across_nodes_and_auto_needs_memfd(monkeypatch):
    """Pins `choose`: an explicit process group or filesystem works with engines on other nodes
    (only shared memory needs one node; the refusal says what to use instead); "auto" never picks
    shared memory where the kernel has no memfd (SharedMemorySync then refuses, naming the
    alternative)."""
    assert transports.choose("process_group", "n1", ["n1", "n2"], cuda=False) == "process_group"
    assert transports.choose("filesystem", "n1", "n2", cuda=True) == "filesystem"
    across = (r'^executor.resident.weight_sync = "shared_memory" needs trainer 0 and every engine on one '
              r'node; trainer 0 is on n1, an engine on n3: use "process_group" or "auto"$')
    with pytest.raises(RuntimeError, match=across):
        transports.choose("shared_memory", "n1", ["n1", "n3", "n2"], cuda=False)
    monkeypatch.delattr(weight_sync.os, "memfd_create")
    assert transports.choose("auto", "n1", "n1", cuda=False) == "process_group"
    with pytest.raises(RuntimeError, match=r'^shared-memory weight sync needs Linux \(memfd\); use '
                                           r'weight_sync = "process_group"$'):
        SharedMemorySync()


def test_make_names_the_registered_transports_and_register_names_the_class(monkeypatch):
    """Pins the registry: an unknown name is refused with the list of registered ones, and
    `register` files a class under its name and sets that name on it (the Handoff carries it)."""
    with pytest.raises(ValueError, match=r"^unknown weight-sync transport 'pigeon'; registered: "
                                         r"process_group, shared_memory, filesystem, saved$"):
        transports.make({"transport": "pigeon"})
    monkeypatch.setattr(transports, "TRANSPORTS", dict(transports.TRANSPORTS))

    class Pigeon(transports.FilesystemTransport):
        pass

    assert transports.register("pigeon")(Pigeon) is Pigeon
    assert Pigeon.name == "pigeon" and transports.TRANSPORTS["pigeon"] is Pigeon
    made = transports.make({"transport": "pigeon", "directory": "/x"})
    assert type(made) is Pigeon and made.setup == transports.SyncSetup("pigeon", directory="/x")


def test_a_saved_policy_is_read_shard_by_shard_and_never_sent(tmp_path):
    """Pins `SavedPolicyTransport`: it reads every safetensors file of the saved folder, in file
    name order (not a glob's arbitrary order), refuses a folder without weights (naming it), and
    refuses to send."""
    from safetensors.torch import save_file

    save_file({"b": torch.arange(3.0)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.ones(2, 2, dtype=torch.bfloat16)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    saved = transports.make(transports.SyncSetup("saved"))
    got = list(saved.receive(transports.Handoff("saved", path=str(tmp_path))))
    assert [n for n, _ in got] == ["a", "b"]
    assert torch.equal(got[0][1], torch.ones(2, 2, dtype=torch.bfloat16)) and torch.equal(got[1][1],
                                                                                           torch.arange(3.0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path / 'empty'}: no safetensors weights$"):
        list(saved.receive(transports.Handoff("saved", path=str(tmp_path / "empty"))))
    with pytest.raises(NotImplementedError,
                       match="^a saved policy is read from the run directory, never sent$"):
        saved.send([("a", torch.zeros(1))])


def test_the_handoff_names_what_the_load_side_reads(tmp_path):
    """Pins each transport's Handoff fields: its name, the bytes sent, and where to read them
    (shared memory: the sender's buffer and the tensors' header; filesystem: the directory)."""
    state = [("w", torch.arange(4.0)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    shm = transports.make(transports.SyncSetup("shared_memory"))
    shm.open_sender()
    h = shm.send(state)
    assert h == transports.Handoff("shared_memory", 22, shm.sync.path,
                                   [["w", "float32", [4], 64], ["b", "bfloat16", [3], 128]], 2)
    fs = transports.make(transports.SyncSetup("filesystem", directory=str(tmp_path / "w")))
    assert fs.send(state) == transports.Handoff("filesystem", 22, str(tmp_path / "w"), [], 2)
    assert shm.send(state).stamp == 4 and fs.send(state).stamp == 4  # each send its own
    assert h.as_dict() == {"transport": "shared_memory", "bytes": 22, "path": shm.sync.path,
                           "header": h.header, "stamp": 2}
    setup = transports.SyncSetup("filesystem", directory="/d", lora_targets=["q_proj"])
    assert setup.as_dict()["directory"] == "/d" and transports.SyncSetup(**setup.as_dict()) == setup


def test_closing_a_process_group_transport_shuts_its_group_down_once():
    """Pins `close`: it shuts the end's group down (a gloo group left to the interpreter's exit
    warns, NCCL's may hang), once however often it is called, and is a no-op on an end that failed
    before opening its group (the run's cleanup still closes it). A broadcast on a shut-down gloo
    group only times out, like one whose peers are gone, so the shutdown is recorded here."""
    t = transports.make(transports.SyncSetup("process_group"))
    t.close()
    assert t.sync is None
    shutdowns = []
    t.sync = SimpleNamespace(pg=SimpleNamespace(shutdown=lambda: shutdowns.append(1)))
    t.close()
    t.close()
    assert shutdowns == [1] and t.sync is None


def test_a_shared_memory_receiver_maps_the_buffer_again_only_when_it_grew():
    """Pins the receiver's mapping reuse: a sync that fits the mapped buffer, exactly filling it
    included, reads through the same mapping (no new mapping per sync); one that needs more maps
    again."""
    setup = transports.SyncSetup("shared_memory")
    sender, receiver = transports.make(setup), transports.make(setup)
    sender.open_sender()
    n = (1 << 14) - 16  # with the stamp's 64 bytes: exactly the first buffer (64 KiB)
    full = [("w", torch.full((n,), 1.0))]
    assert dict(receiver.receive(sender.send(full)))["w"].sum() == n
    mapped = receiver.buffer
    assert mapped.numel() == 1 << 16
    full[0][1].fill_(2.0)
    assert dict(receiver.receive(sender.send(full)))["w"].sum() == 2 * n and receiver.buffer is mapped
    bigger = [("w", torch.full((n,), 3.0)), ("v", torch.ones(1))]
    got = dict(receiver.receive(sender.send(bigger)))
    assert receiver.buffer is not mapped and receiver.buffer.numel() == 1 << 17
    assert got["w"].sum() == 3 * n and got["v"].tolist() == [1.0]
    assert list(receiver.receive(sender.send([]))) == []  # an empty sync reads nothing, maps nothing


def _in_threads(*calls, timeout_s: float = 30):
    """Run the calls at once, each in its own thread of this process (so mutation testing, which
    records the calls a test makes in its own process, sees both ends of a group); their results,
    or the first exception."""
    import threading

    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(t.is_alive() for t in threads) and not errors and time.monotonic() < deadline:
        time.sleep(0.01)  # the first failure ends the test: the other ends would wait for their timeout
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "an end of the group hung"
    return results


@pytest.mark.timeout(120)
def test_a_process_group_transport_delivers_to_every_worker_in_one_process():
    """Both ends of the process-group transport in threads of this process (the spawned-process
    tests above are invisible to mutation testing): trainer 0 sends in small buckets of mixed
    dtypes and shapes, the two tensor-parallel workers of an engine each open their own rank and
    receive every tensor bit-identical, in order; the Handoff names the transport and the bytes
    sent. Pins the header (names, dtypes, shapes), the flat buffers' offsets, the end marker, the
    ranks and the store the receivers join."""
    from datetime import timedelta

    import torch.distributed as dist

    from hpcrl.distributed import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=20),
                          wait_for_workers=False)
    setup = transports.SyncSetup("process_group", "127.0.0.1", port, tp=2, timeout_s=20, bucket_bytes=1024)
    state = _state()
    state["bias.0"] = torch.arange(5, dtype=torch.float64).reshape(5, 1)
    state["empty"] = torch.zeros(0, 3)
    sender, receivers = transports.make(setup), [transports.make(setup.as_dict()) for _ in range(2)]

    def send():
        sender.open_sender(store)
        return sender.send(iter(state.items()))

    def receive(tp_rank):
        def run():
            receivers[tp_rank].open_receiver(0, tp_rank)
            got = [(n, str(t.dtype), list(t.shape), _raw(t))
                   for n, t in receivers[tp_rank].receive(transports.Handoff("process_group"))]
            return receivers[tp_rank].sync.rank, got
        return run

    handoff, *got = _in_threads(send, receive(0), receive(1))
    try:
        assert handoff == transports.Handoff("process_group", sum(t.numel() * t.element_size()
                                                                  for t in state.values()))
        expected = [(n, str(t.dtype), list(t.shape), _raw(t)) for n, t in state.items()]
        assert got == [(1, expected), (2, expected)]  # each worker its own rank, every tensor, in order
    finally:
        for end in (sender, *receivers):
            end.close()


@pytest.mark.timeout(120)
def test_the_process_group_mechanism_per_tensor_and_bucketed_in_one_process():
    """`make_group` and `ProcessGroupSync` with a sender and two receivers in this process:
    per-tensor (bucket 0), small buckets and one bucket all deliver the same tensors to both, and
    `send` counts every byte. Pins the byte strings' lengths (the header of each bucket, then the
    empty end marker) and rank 0 alone hosting the store (two hosts of one port fail)."""
    from hpcrl.distributed import free_port

    state = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": -torch.ones(3),  # 2 in 100 B
             "b": torch.arange(300.0),
             "e": torch.arange(5.0), "f": -torch.arange(7.0), "g": torch.ones(2),  # one bucket of 100 B
             "c": torch.tensor([1, -2, 3], dtype=torch.int32), "d": torch.ones(2, 2, dtype=torch.bfloat16)}
    expected = [(n, str(t.dtype), list(t.shape), _raw(t)) for n, t in state.items()]
    for bucket_bytes in (0, 100, 1 << 20):
        port = free_port()

        def rank(r, bucket_bytes=bucket_bytes, port=port):
            def run():
                pg, store = make_group("127.0.0.1", port, r, 3, timeout_s=20)
                sync = ProcessGroupSync(pg, r, bucket_bytes)
                if r == 0:
                    out = sync.send(iter(state.items()))
                else:
                    out = [(n, str(t.dtype), list(t.shape), _raw(t)) for n, t in sync.receive()]
                pg.shutdown()
                return out
            return run

        sent, *got = _in_threads(rank(0), rank(1), rank(2))
        assert sent == 48 + 12 + 1200 + 20 + 28 + 8 + 12 + 8, bucket_bytes
        assert got == [expected, expected], bucket_bytes


def test_the_shared_buffer_lays_tensors_out_on_cache_lines_and_grows_by_doubling():
    """Pins `SharedMemorySync`'s layout and growth: each tensor starts on a 64-byte boundary after
    the previous one (the header gives name, dtype, shape and offset), the byte count is the
    tensors' own; the buffer is a memfd named hpcrl-weights, at least 64 KiB, kept while a send
    fits (exactly filling it included), else grown to the larger of twice its size and what the
    send needs, in the same file (the path the receivers map does not change)."""
    import os

    sync = SharedMemorySync()
    assert sync.path is None and sync.buffer is None  # nothing until the first send
    state = [("w", torch.arange(4.0)), ("b", torch.ones(3, dtype=torch.bfloat16)),
             ("i", torch.tensor([[1, 2], [3, 4]])), ("z", torch.zeros(16))]
    nbytes, header, stamp = sync.send(state)
    assert nbytes == 16 + 6 + 32 + 64 and stamp == 2 == SharedMemorySync.stamp_of(sync.buffer)
    assert header == [["w", "float32", [4], 64], ["b", "bfloat16", [3], 128], ["i", "int64", [2, 2], 192],
                      ["z", "float32", [16], 256]]  # after the stamp's cache line
    assert SharedMemorySync.end(header) == 320
    assert SharedMemorySync.end(header[:2]) == 134
    path = sync.path
    assert os.readlink(path).startswith("/memfd:hpcrl-weights")
    assert sync.buffer.numel() == 1 << 16
    mapped = SharedMemorySync.map(path, header)
    assert [(n, t.tolist()) for n, t in SharedMemorySync.receive(mapped, header)] == \
        [(n, t.tolist()) for n, t in state]
    first = sync.buffer
    sync.send([("x", torch.zeros((1 << 14) - 16))])  # 64 KiB with the stamp: fills the buffer exactly
    assert sync.buffer is first
    sync.send([("x", torch.zeros((1 << 14) - 16)), ("y", torch.zeros(1))])  # 64 KiB + 4: doubled
    assert sync.buffer.numel() == 1 << 17 and sync.path == path
    _, header, stamp = sync.send([("x", torch.arange(75_000.0))])  # 300,064 B, more than twice: as needed
    assert sync.buffer.numel() == 300_064 == SharedMemorySync.end(header) and sync.path == path
    assert stamp == 8 == SharedMemorySync.stamp_of(sync.buffer)  # kept when the buffer grew
    got = dict(SharedMemorySync.receive(SharedMemorySync.map(path, header), header))
    assert torch.equal(got["x"], torch.arange(75_000.0))


def test_mapping_a_buffer_smaller_than_its_header_is_refused():
    """Pins the receiver's size check: a buffer exactly as large as the header needs maps; a
    header reaching past it (a sender that grew the buffer after this header was written, or
    another sender's buffer) is refused with both sizes, never read out of bounds."""
    from hpcrl.weight_sync import WeightSyncError

    sync = SharedMemorySync()
    _, header, _ = sync.send([("x", torch.zeros((1 << 14) - 16))])
    assert SharedMemorySync.map(sync.path, header).numel() == 1 << 16
    too_far = [["x", "float32", [(1 << 14) - 16], 128]]
    with pytest.raises(WeightSyncError, match=rf"^the shared weight buffer {sync.path} holds 65536 bytes, "
                                              r"the header needs 65600$"):
        SharedMemorySync.map(sync.path, too_far)


def test_buckets_hold_exactly_up_to_their_size_and_copy_no_tensor():
    """Pins `buckets`' accounting: a bucket takes tensors while their bytes reach at most
    `bucket_bytes` (an exact fill stays one bucket), a larger tensor goes alone, and each tensor is
    handed on as it is (detached, contiguous: a non-contiguous view is made contiguous)."""
    ts = [("a", torch.zeros(8)), ("b", torch.zeros(8)), ("c", torch.zeros(40)), ("d", torch.zeros(4))]
    assert [[n for n, _ in b] for b in weight_sync.buckets(ts, 64)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in weight_sync.buckets(ts, 65)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in weight_sync.buckets(ts, 63)] == [["a"], ["b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in weight_sync.buckets(ts, 224)] == [["a", "b", "c"], ["d"]]
    assert [[n for n, _ in b] for b in weight_sync.buckets(ts, 240)] == [["a", "b", "c", "d"]]
    assert list(weight_sync.buckets([], 64)) == []
    empty, byte = torch.zeros(0, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
    assert [len(b) for b in weight_sync.buckets([("e", empty), ("f", empty)], 0)] == [1, 1]  # 0: one each
    assert [len(b) for b in weight_sync.buckets([("a", byte), ("e", empty)], 1)] == [2]  # 1 byte fits 1 + 0
    w = torch.arange(6.0, requires_grad=True).reshape(2, 3)
    (bucket,) = weight_sync.buckets([("t", w.t())], 1 << 20)
    t = bucket[0][1]
    assert t.is_contiguous() and not t.requires_grad and t.tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]


def test_a_directory_without_a_stamp_counts_as_none_sent(tmp_path):
    """An index written before sends were stamped (a run resumed across an upgrade) reads as
    stamp 0: the next send is send 1."""
    import json

    (tmp_path / "weights.json").write_text(json.dumps({"shards": []}))
    assert FilesystemSync(tmp_path).stamp() == 0
    assert FilesystemSync(tmp_path).send([("a", torch.ones(2))]) == (8, 2)
    assert FilesystemSync(tmp_path / "new").stamp() == 0


def test_the_filesystem_sync_counts_its_bytes_and_creates_its_directory(tmp_path):
    """Pins `FilesystemSync.send`: it creates a missing directory and its parents, returns the
    bytes of every shard (mixed dtypes share a shard), names shards by their index and lists them
    in the index file, which the receiver follows."""
    import json

    state = [("a", torch.arange(4.0)), ("b", torch.ones(3, dtype=torch.bfloat16)), ("c", torch.arange(8.0))]
    sync = FilesystemSync(tmp_path / "x" / "y", shard_bytes=24)
    assert sync.send(state) == (16 + 6 + 32, 2)
    assert json.loads((tmp_path / "x" / "y" / "weights.json").read_text()) == {
        "shards": ["weights-00000.safetensors", "weights-00001.safetensors"], "stamp": 2}
    assert sorted(p.name for p in (tmp_path / "x" / "y").iterdir()) == [
        "weights-00000.safetensors", "weights-00001.safetensors", "weights.json"]
    assert [(n, t.tolist()) for n, t in FilesystemSync(str(tmp_path / "x" / "y")).receive()] == \
        [(n, t.tolist()) for n, t in state]


def test_a_process_group_transport_builds_its_group_from_the_setup(monkeypatch):
    """Pins what `ProcessGroupTransport` passes on (recorded, no group formed): trainer 0 is rank
    0 of a group of 1 + engines x tp ranks; a worker joins the run's store as a client (never a
    second server) with the setup's timeout, as its own rank; both ends use the setup's backend
    (NCCL between GPUs), timeout, bucket size and device."""
    from datetime import timedelta

    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(weight_sync, "group_on", lambda *a: calls.append(("group", *a)) or f"pg{a[1]}")
    monkeypatch.setattr(weight_sync, "ProcessGroupSync", lambda *a: calls.append(("sync", *a)))

    class Store:
        def __init__(self, host, port, **kw):
            calls.append(("store", host, port, kw["is_master"], kw["timeout"]))

    monkeypatch.setattr(dist, "TCPStore", Store)
    setup = transports.SyncSetup("process_group", "n7", 4242, engines=2, tp=3, timeout_s=42.0,
                                 bucket_bytes=777, backend="nccl")
    transports.make(setup).open_sender("the run's store", device="cuda:0")
    assert calls == [("group", "the run's store", 0, 7, 42.0, "nccl"), ("sync", "pg0", 0, 777, "cuda:0")]
    calls.clear()
    worker = transports.make(setup.as_dict())
    worker.open_receiver(1, 2, device="cuda:2")
    assert calls[0] == ("store", "n7", 4242, False, timedelta(seconds=42.0))
    assert calls[1:] == [("group", worker.store, 6, 7, 42.0, "nccl"), ("sync", "pg6", 6, 777, "cuda:2")]


def test_an_nccl_weight_sync_group_gets_the_timeout_and_a_gloo_one_by_default(monkeypatch):
    """Pins `group_on`'s choice (recorded, no GPU needed): backend "nccl" makes an NCCL group
    over the prefixed store with the timeout in its options (NCCL's own default is 10 minutes);
    anything else, and the default, a gloo group with the timeout; and `make_group` hosts the
    store on rank 0 only, sized for the whole group, with the caller's timeout (300 s unless
    given)."""
    from datetime import timedelta

    import torch.distributed as dist

    made = []

    class Group:
        def __init__(self, kind):
            self.kind = kind

        def __call__(self, store, rank, world_size, opts):
            made.append((self.kind, type(store).__name__, rank, world_size, getattr(opts, "_timeout", opts)))
            return self.kind

    class NCCL(Group):
        class Options:
            _timeout = None

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCL("nccl"), raising=False)
    monkeypatch.setattr(dist, "ProcessGroupGloo", Group("gloo"))
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: made.append(("prefix", prefix, store)) or
                        SimpleNamespace())
    assert weight_sync.group_on("store", 2, 5, 12.0, "nccl") == "nccl"
    assert weight_sync.group_on("store", 1, 3, 7.0) == "gloo"
    prefixed = ("prefix", "hpcrl-weights", "store")
    assert made == [prefixed, ("nccl", "SimpleNamespace", 2, 5, timedelta(seconds=12)),
                    prefixed, ("gloo", "SimpleNamespace", 1, 3, timedelta(seconds=7))]
    stores, groups = [], []
    monkeypatch.setattr(weight_sync, "tcp_store", lambda *a: stores.append(a) or f"store{len(stores)}")
    monkeypatch.setattr(weight_sync, "group_on", lambda *a: groups.append(a) or "pg")
    assert weight_sync.make_group("h", 9, 0, 3, timeout_s=4.0) == ("pg", "store1")
    weight_sync.make_group("h", 9, 1, 3)
    weight_sync.make_group("h", 9, 2, 3)
    assert stores == [("h", 9, 3, True, 4.0), ("h", 9, 3, False, 300), ("h", 9, 3, False, 300)]
    assert groups == [("store1", 0, 3, 4.0), ("store2", 1, 3, 300), ("store3", 2, 3, 300)]
