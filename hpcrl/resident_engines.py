"""The vLLM engines of a resident job (generate.engines = N): generator tasks, each holding an
engine for the run. Generator 0 leads (hpcrl.resident_generator: it walks the plan, commands the
trainers, scores, and merges each generation); engines 1..N-1 serve its commands on a channel of
their own ("engine<e>", hpcrl.roles):

- "load": a saved policy version, read from the run directory (a resumed run's first generations);
- "sync": an update's weights, from the same send of trainer 0 that reaches engine 0 (one
  broadcast to every engine's workers, or the shared-memory buffer or directory its handoff
  names), then the probe's logprobs, which the leader checks against the trainer's;
- generate: shards of an iteration's generate stage (hpcrl.shards), each committed under
  iter_K/generate.shards/ as a staged shard job commits it, once the update that made its policy
  is committed: engine e samples shard e, then claims the next one no engine has taken (a counter
  in the job's store), until none is left (`claim_shards`; generate.shards > N balances engines
  of unequal speed);
- "stop".

No engine reads the policy it starts from off the shared filesystem: each starts with random
weights (vLLM's "dummy" load format) and takes the trainers' through the same sync as an update's,
before the first generation (a resubmitted job's engines too); only a resumed run's generations
of versions older than the trainers' load saved versions from the run directory. Every engine
loads every version the leader loads, so all hold the same policy. `Fleet` is the
leader's side: a command to the other engines, then their replies. The shard counter is the one
value of the job's store that is not signed (hpcrl.roles): a client without the job's secret could
make the engines skip shards, which the merge then finds missing (the job stops), but could not
change what a shard holds.
"""

from __future__ import annotations

import os
import time

from hpcrl import commit, resident_sync, stage_kinds, transports, versions
from hpcrl.config import Experiment
from hpcrl.roles import ControlPlane
from hpcrl.rundir import RunDir
from hpcrl.stage import run_stage
from hpcrl.stage_kinds import GENERATE


def open_engine(exp: Experiment, run: RunDir, plane: ControlPlane, index: int):
    """The generate stage object of engine `index` (hpcrl.generation.GenerateStage: vLLM with the
    weight receiver open, holding no policy until trainer 0 sends the one it starts from), and the
    weight sync it takes part in."""
    from hpcrl.generation import GenerateStage

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # vLLM sets up its own (single-process) distributed state
    gen = GenerateStage(exp, run, resident=True)
    gen.startup()
    sync = resident_sync.sync_setup(exp, run, plane, f"engine{index}")
    gen.setup_empty(exp.run.seed)
    gen.llm.collective_rpc("hpcrl_open_sync", args=(sync.as_dict(), index))
    return gen, sync


def load_saved(gen, run: RunDir, exp: Experiment, version: int) -> bool:
    """The engine of `gen` set to saved policy `version` (read from the run directory), unless it
    holds it; whether it loaded."""
    if gen.version == version:
        return False
    path = commit.verified(run.policy_dir(version, exp.model.path))
    handoff = transports.Handoff("saved", path=str(path))
    gen.llm.collective_rpc("hpcrl_load_weights", args=(handoff.as_dict(),))
    gen.llm.reset_prefix_cache()
    gen.version, gen.metrics = version, {}
    return True


class Engine:
    """Engine `index` > 0: serves the leader's commands until "stop"."""

    def __init__(self, run: RunDir, exp: Experiment, plane: ControlPlane, index: int):
        self.run, self.exp, self.plane, self.index = run, exp, plane, index
        self.channel = f"engine{index}"
        self.gen, self.sync = open_engine(exp, run, plane, index)

    def serve(self) -> None:
        ops = {"load": self._load, "sync": self._sync, GENERATE: self._generate}
        while (cmd := self.plane.receive(self.channel))["op"] != "stop":
            self.plane.reply(ops[cmd["op"]](cmd), self.channel)
        self.plane.stop_monitor()  # before trainer 0, which hosts the store, ends
        self.plane.reply({}, self.channel)
        self.gen.llm.collective_rpc("hpcrl_close_sync")
        self.gen.close()

    def _load(self, cmd: dict) -> dict:
        load_saved(self.gen, self.run, self.exp, cmd["version"])
        return {}

    def _sync(self, cmd: dict) -> dict:
        t0 = time.perf_counter()
        handoff = cmd["handoff"] or transports.Handoff(self.sync.transport).as_dict()  # a stream: no handoff
        self.gen.llm.collective_rpc("hpcrl_load_weights", args=(handoff,))
        self.gen.llm.reset_prefix_cache()
        self.gen.version, self.gen.metrics = cmd["version"], {}
        load_s = time.perf_counter() - t0
        return {"probe": resident_sync.engine_logprobs(self.gen.llm, cmd["probe"]), "load_s": load_s}

    def _generate(self, cmd: dict) -> dict:
        k, made_by = cmd["iteration"], cmd["await"]
        versions.check_engine(self.index, self.gen.version, cmd["version"], k)
        self.gen.await_policy = versions.awaiting(made_by, lambda u: self.plane.wait_signal(f"committed/{u}"))
        return {"shards": claim_shards(self.plane, self.gen, self.run, k, self.index, cmd["claim"])}


def claim_shards(plane: ControlPlane, gen, run: RunDir, iteration: int, engine: int, key: str) -> list[int]:
    """The shards of the generation of `iteration` this engine samples and commits: its own
    (shard `engine`), then those it claims from the counter `key` of the job's store (one past the
    engines' own, counted atomically by every engine), until none is left. A shard committed by an
    earlier attempt is not sampled again."""
    n, engines = stage_kinds.kind(GENERATE).shards(gen.exp), gen.exp.generate.engines
    taken, i = [], engine
    while i < n:
        run_stage(GENERATE, run.root, iteration, gen.run, startup=0.0, shard=(i, n))
        taken.append(i)
        i = engines + plane.store.add(key, 1) - 1
    return taken


class Fleet:
    """The leader's side of engines 1..N-1: a command sent to each, then their replies in engine
    order."""

    def __init__(self, plane: ControlPlane, engines: int):
        self.plane, self.channels = plane, [f"engine{e}" for e in range(1, engines)]

    def send(self, command: dict) -> list[tuple[str, int]]:
        return [(channel, self.plane.send(command, channel)) for channel in self.channels]

    def wait(self, sent: list[tuple[str, int]]) -> list[dict]:
        return [self.plane.wait_reply(seq, channel) for channel, seq in sent]
