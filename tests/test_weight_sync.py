"""Weight transport between processes: a dedicated gloo group, the shared-memory buffer and the
filesystem fallback deliver the trainer's tensors bit-identical (bucketed or per tensor)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hpcrl.distributed import free_port
from hpcrl.weight_sync import FilesystemSync, ProcessGroupSync, SharedMemorySync, make_group, transport


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
    state["lm_head.weight"] = state["embed.weight"]  # tied: stored once, delivered under both names
    sync = SharedMemorySync()
    nbytes, header = sync.send(state.items())
    assert nbytes == sum(t.numel() * t.element_size() for k, t in state.items() if k != "lm_head.weight")
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


def test_shared_memory_refuses_weights_that_grew():
    sync = SharedMemorySync()
    sync.send([("w", torch.zeros(4))])
    with pytest.raises(ValueError, match="grew from 64 to 128 bytes"):
        sync.send([("w", torch.zeros(4)), ("v", torch.zeros(4))])


def test_auto_transport_is_shared_memory_on_one_cpu_node_else_a_process_group():
    assert transport("auto", "n1", "n1", cuda=False) == "shared_memory"
    assert transport("auto", "n1", "n2", cuda=False) == "process_group"
    assert transport("auto", "n1", "n1", cuda=True) == "process_group"
    assert transport("filesystem", "n1", "n1", cuda=False) == "filesystem"


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
    from hpcrl import config, resident
    from hpcrl.weight_sync import WeightSyncError, check_probe, probe_tolerance

    path = tmp_path / "e.toml"
    path.write_text(c.experiment_toml(tiny_task, tmp_path / "runs"))
    exp = config.load(path)
    assert exp.model.dtype == "float32"
    model = AutoModelForCausalLM.from_pretrained(tiny_task / "model", dtype=torch.float32).eval()
    probe = resident.probe_sequences(exp, AutoTokenizer.from_pretrained(tiny_task / "model"))
    trainer = _logprobs(model, probe)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    served = _logprobs(rounded, probe)
    tol = probe_tolerance(exp)
    assert check_probe(_logprobs(copy.deepcopy(model), probe), trainer, trainer, tol,
                       version=1)["sync/logp_diff"] == 0
    with pytest.raises(WeightSyncError, match=r"differ from the trainer's by [0-9.e+-]+ on average, "
                                              r"above the tolerance 1e-04"):
        check_probe(served, trainer, trainer, tol, version=1)


@pytest.mark.parametrize("side", ["engine", "trainer"])
def test_a_non_finite_probe_is_refused(side):
    """Pins: NaN compared against the tolerance (NaN > tol is false, so a NaN policy passed)."""
    from hpcrl.weight_sync import WeightSyncError, check_probe

    good, bad = [[-1.0, -2.0]], [[float("nan"), -2.0]]
    engine, trainer = (bad, good) if side == "engine" else (bad, bad)
    with pytest.raises(WeightSyncError, match="not finite"):
        check_probe(engine, trainer, good, 1e-4, version=2)
