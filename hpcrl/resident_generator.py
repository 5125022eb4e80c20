"""Generator 0 of the resident job (hpcrl.resident): the generate and score stage objects (its
vLLM engine, the reward workers) kept for the run, and the loop over the run's stages.

It walks the plan (hpcrl.plan) and runs each stage through hpcrl.stage; an update it commands to
the trainers (hpcrl.resident_trainer) and goes on. A generation's writes and commit run on a
background thread (hpcrl.resident_commits) while the engine loads the next weights and samples the
next generation; its score starts once it is committed. With generate.engines = N it leads
the other engines (hpcrl.resident_engines): every engine loads each version it loads, each
generation is N shards, one per engine, merged once all are committed. With algorithm.max_staleness = s
the generations of the next s iterations run while the trainers update: the engine loads an
update's weights only when a generation needs that version (between two generations, so no
sample mixes versions), and a generation commits only once the update that made its policy has;
each score stage then runs on a thread beside the next generation, which commands its update
(hpcrl.resident_scores).
"""

from __future__ import annotations

import collections
import time

from hpcrl import (
    agreement,
    commit,
    plan,
    resident_engines,
    resident_sync,
    stage_kinds,
    transports,
    versions,
    weight_sync,
)
from hpcrl.config import Experiment
from hpcrl.resident_commits import CommitsBehind
from hpcrl.resident_scores import BesideScores
from hpcrl.roles import ControlPlane
from hpcrl.rundir import RunDir
from hpcrl.stage import OpenStage, run_stage
from hpcrl.stage_kinds import GENERATE, SCORE, UPDATE


class Generator:
    """The generator task: the generate and score stage objects (vLLM engine, reward pool), and
    the loop over the run's stages."""

    def __init__(self, run: RunDir, exp: Experiment, plane: ControlPlane):
        from hpcrl.scoring import ScoreStage

        self.run, self.exp, self.plane = run, exp, plane
        self.colocated = resident_sync.vllm_sleeps(exp)
        if self.colocated:  # vLLM starts into the memory the trainers released (hpcrl.colocation)
            for rank in range(exp.update.world_size):
                plane.wait_signal(f"released/{rank}")
        self.gen, self.sync = resident_engines.open_engine(exp, run, plane, 0)
        self.score = ScoreStage(exp, run, resident=True)
        self.base = run.latest_saved_version()  # the trainers start from it, and send it (`_start`)
        self.llm = self.gen.llm
        self.fleet = resident_engines.Fleet(plane, exp.generate.engines)
        engines = f" of {exp.generate.engines} engines" if exp.generate.engines > 1 else ""
        print(f"[resident] weights reach vLLM{engines} through {self.sync.transport.replace('_', ' ')}",
              flush=True)
        self.score.setup(self.base, exp.run.seed)
        self.gen.pool = self.score.pool  # dynamic sampling scores its rounds on the same workers
        self.probe = resident_sync.probe_sequences(exp, self.llm.get_tokenizer())
        self.inflight: collections.deque[tuple[int, int]] = collections.deque()  # (update, command seq)
        self.progress = plan.Progress(run, exp)
        self.started: set[int] = set()  # the updates this job commanded
        self.uncommitted: set[int] = set()  # those whose commit it has not seen yet
        self.made_by: int | None = None  # the uncommitted update the next generation waits for
        # trainer 0 sends an update's weights as soon as it ends, not when a generation needs them
        # (hpcrl.resident_trainer), where the transport holds them until loaded (it does not stream)
        streams = transports.TRANSPORTS[self.sync.transport].streams
        self.presend = exp.algorithm.max_staleness > 0 and not streams
        self.loads = 0  # the weight sends every engine has loaded (`loaded/<n>` for trainer 0)
        self.commits = CommitsBehind()  # each generation's writes and commit, behind the next one
        self.beside = None  # the score stages on a thread beside the generations
        if resident_sync.scores_beside(exp):
            self.beside = BesideScores(lambda k: self._score(k, beside=True), self._command_update,
                                       lambda k: plan.trains(exp, k))

    def drive(self) -> None:
        ended = False
        try:
            self._start()
            while (nxt := self._next_stage()) is not None:
                k, name = nxt
                if name == UPDATE:
                    self._collect(until=k)  # the updates before it, commanded from the scoring thread
                    self._start_update(k)
                elif name == GENERATE:
                    self._hold(plan.policy_version(self.exp, k))
                    self._generate(k)
                elif self.beside is not None:
                    self.beside.submit(k)
                else:
                    self._score(k)
            self._collect(until=self.exp.run.iterations)
            while self.inflight:
                self._finish_update()
            self._await_commit(*sorted(self.uncommitted))
            self.commits.wait()
            ended = True
        finally:  # after an error, the threads are not waited for (resident.py raises the failure flag)
            if self.beside is not None:
                self.beside.close(wait=ended)
            self.commits.close(wait=ended)
            self.score.close()
        self.fleet.wait(self.fleet.send({"op": "stop"}))
        self.plane.send({"op": "stop"})
        self.llm.collective_rpc("hpcrl_close_sync")
        self.plane.stop_monitor()  # before trainer 0, which hosts the store, ends
        self.gen.close()

    def _generate(self, k: int) -> None:
        """The generate stage of iteration k: sampled whole on one engine, or in shards over the
        engines (resident_engines.claim_shards; those committed by an earlier attempt are kept),
        merged in one engine's order (hpcrl.shards); the rest of the stage (its writes and commit)
        runs behind the next one (hpcrl.resident_commits)."""
        self.commits.check()
        kind = stage_kinds.kind(GENERATE)
        n = kind.shards(self.exp)
        if n == 1:
            self._sample(k)
            return
        claim = f"claim/{GENERATE}/{k}"
        sent = self.fleet.send({"op": GENERATE, "iteration": k, "version": self.gen.version,
                                "await": self.made_by, "claim": claim})
        resident_engines.claim_shards(self.plane, self.gen, self.run, k, 0, claim)
        self.fleet.wait(sent)
        merge, sync_metrics = kind.merge_function(), self.gen.metrics

        def merged(ctx) -> None:
            merge(ctx, n)
            ctx.writer.metrics.update(sync_metrics)

        attempt = OpenStage(GENERATE, self.run.root, k, startup=0.0)
        if attempt.ctx is not None:
            self.commits.submit(k, attempt, merged)

    def _sample(self, k: int) -> None:
        """Sample generation k on the engine, and hand the rest of its stage to the commit thread,
        with the state of now (the loop goes on to load and sample the next)."""
        attempt = OpenStage(GENERATE, self.run.root, k, startup=0.0)
        if attempt.ctx is None:
            return
        rest = []
        attempt.run(lambda ctx: rest.append(self.gen.sample(ctx)))
        self.commits.submit(k, attempt, rest[0])

    def _start(self) -> None:
        """Before any iteration: every engine takes the weights the trainers start from (trainer 0
        sends them as after an update; no engine reads them off the shared filesystem), and each
        engine and the trainer, holding the same weights, must compute the same probe logprobs
        (hpcrl.agreement.check_start)."""
        if self.colocated:  # asleep while the trainers restore their state; awake for the sync
            self.llm.sleep(level=2)
        seq = self.plane.send({"op": "start", "probe": self.probe})
        if self.colocated:
            self.plane.wait_signal("sending/start")
            self.llm.wake_up(tags=["weights"])
        reply, sync, others = self._load_weights(seq, self.base, time.perf_counter())
        if self.colocated:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.gen.version = self.base
        tol = weight_sync.probe_tolerance(self.exp.executor.resident.sync_check_tol, self.exp.model.dtype)

        def check(engine_lp: list, who: str = "") -> dict:
            return agreement.check_start(engine_lp, reply["logprobs"], tol, reply["attn_implementation"],
                                         f"{who}{self.exp.model.path}")

        metrics = check(resident_sync.engine_logprobs(self.llm, self.probe))
        for e, answer in enumerate(self.fleet.wait(others), 1):
            check(answer["probe"], f"engine {e}: ")
        self._loaded()
        nbytes = float(reply["handoff"]["bytes"])
        print(f"[resident] the engines took policy version {self.base} from trainer 0 ({nbytes / 1e6:.1f} MB "
              f"in {sync['seconds']:.2f} s); trainer and vLLM agree on the probe: "
              f"{metrics['sync/start_logp_diff']:.1e} (tolerance {tol:.0e})", flush=True)
        self.gen.metrics = {**metrics, "sync/start_seconds": sync["seconds"], "sync/start_bytes": nbytes}
        self.noise = metrics["sync/start_logp_diff"]  # what the probe cannot resolve (check_probe)

    def _next_stage(self) -> tuple[int, str] | None:
        """The next stage to run: the first uncommitted one, but for the updates already commanded
        and the scores (with their updates) handed to the scoring thread."""
        self._collect()
        owned = self.beside.owns if self.beside is not None else (lambda k: False)
        return next(((k, s) for k, s in self.progress.pending()
                     if not (s == UPDATE and k in self.started) and not (s in (SCORE, UPDATE) and owned(k))
                     and not (s == GENERATE and self.commits.handed(k))), None)

    def _collect(self, until: int | None = None) -> None:
        """The updates the scoring thread commanded, in flight from now on (those of the scores up
        to iteration `until` awaited)."""
        for k, seq in self.beside.collect(until) if self.beside is not None else ():
            self._in_flight(k, seq)

    def _score(self, k: int, beside: bool = False) -> None:
        """The score stage of iteration k, once its generation is committed (`beside`: on the
        scoring thread); the trainers meanwhile compute the part of update k that needs no scores
        (hpcrl.update_ahead: its commands come in order, after update k - 1's)."""
        self.commits.wait(k)
        rollouts = self.commits.written(k).get("rollouts")  # as committed, not read back
        updates = plan.trains(self.exp, k) and not commit.is_committed(self.run.stage_dir(k, UPDATE))
        if updates and not self.colocated:
            self.plane.send({"op": "prepare", "iteration": k})  # what update k needs no score for
        run_stage(SCORE, self.run.root, k, lambda ctx: self.score.run(ctx, rollouts), startup=0.0,
                  beside=beside)

    def _hold(self, version: int) -> None:
        """The engine holds policy `version` for the next generation: the updates in flight up to
        it finished (their weights loaded, in order), and the generation commits only once the
        update that made it has (`generate`'s await_policy)."""
        self._collect(until=version - 1)  # the score of the update that makes it, when on the thread
        versions.hold(version, self.base, lambda: self.gen.version, self.inflight, self._load_saved,
                      self._finish_update)
        self.made_by = versions.made_by(version, self.uncommitted)
        self.gen.await_policy = versions.awaiting(self.made_by, self._await_commit)  # on the commit thread

    def _await_commit(self, *updates: int) -> None:
        """Until the trainers have committed these updates (the ones this job commanded); from
        either thread (the commit thread's discard is one atomic set operation)."""
        for k in updates:
            self.plane.wait_signal(f"committed/{k}")
            self.uncommitted.discard(k)

    def _start_update(self, k: int) -> None:
        """Command the update of iteration k; with max_staleness > 0 the next generations run while
        the trainers update (its weights are loaded when a generation needs them: `_hold`)."""
        if self.colocated:  # free vLLM's GPU memory (weights and KV cache) for the update
            self.llm.sleep(level=2)
        self._in_flight(k, self._command_update(k))

    def _command_update(self, k: int) -> int:
        """Command the update of iteration k (from either thread); its command number."""
        return self.plane.send({"op": UPDATE, "iteration": k, "probe": self.probe, "presend": self.presend,
                                "checkpoint": resident_sync.checkpoint_due(self.exp, k)})

    def _in_flight(self, k: int, seq: int) -> None:
        self.inflight.append((k, seq))
        self.started.add(k)
        self.uncommitted.add(k)

    def _finish_update(self) -> None:
        """The oldest update in flight: its weights into every engine, then the probe check on each."""
        k, seq = self.inflight.popleft()
        self._load_saved(k)  # the update's own starting point (only a resumed run's engine lacks it)
        if not self.presend:  # trainer 0 sends only now: no collective waits on a generation
            self.plane.signal(f"receive/{k}")
        # through the update on the control plane: vLLM's weights stay asleep, and its receive is
        # posted only when trainer 0 sends (not under the NCCL watchdog for the whole update)
        waited = time.perf_counter()
        self.plane.wait_signal(f"sending/{k}")
        if self.colocated:
            self.llm.wake_up(tags=["weights"])
        reply, sync, others = self._load_weights(seq, k + 1, waited)
        if self.colocated:  # after the reply: trainer 0 has released its weights
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.gen.version = k + 1
        if not resident_sync.commits_behind(self.exp, self.presend):
            self._await_commit(k)
        t0 = time.perf_counter()
        engine_lp = resident_sync.engine_logprobs(self.llm, self.probe)
        probe_s = time.perf_counter() - t0
        trainer_lp = self.plane.wait_reply(seq, part="probe")  # the trainer's, computed after its send
        metrics = {**self._check_probe(engine_lp, trainer_lp, k + 1), "sync/probe_s": probe_s}
        for e, answer in enumerate(self.fleet.wait(others), 1):  # theirs, computed beside the leader's
            self._check_probe(answer["probe"], trainer_lp, k + 1, f"engine {e}: ")
        self._loaded()
        nbytes = float(reply["handoff"]["bytes"])
        self.gen.metrics = {**metrics, **{f"sync/{name}": v for name, v in sync.items()},
                            "sync/bytes": nbytes, "sync/gb_per_s": nbytes / max(sync["seconds"], 1e-9) / 1e9}

    def _loaded(self) -> None:
        """Every engine holds the weights of the last send: trainer 0 may rewrite what it sent."""
        self.loads += 1
        self.plane.signal(f"loaded/{self.loads}")

    def _check_probe(self, engine_lp: list, trainer_lp: dict, version: int, who: str = "") -> dict:
        tol = weight_sync.probe_tolerance(self.exp.executor.resident.sync_check_tol, self.exp.model.dtype)
        try:
            return weight_sync.check_probe(engine_lp, trainer_lp["probe_new"], trainer_lp["probe_old"], tol,
                                           version=version, noise=getattr(self, "noise", None))
        except weight_sync.WeightSyncError as err:
            raise weight_sync.WeightSyncError(f"{who}{err}") from None

    def _load_saved(self, version: int) -> None:
        """Every engine set to saved policy `version` (read from the run directory), unless it holds it."""
        if self.gen.version == version:
            return
        sent = self.fleet.send({"op": "load", "version": version})
        resident_engines.load_saved(self.gen, self.run, self.exp, version)
        self.fleet.wait(sent)
        print(f"[resident] the engines loaded the saved policy version {version}", flush=True)

    def _load_weights(self, seq: int, version: int, waited: float) -> tuple[dict, dict, list]:
        """The trainer's reply to update command `seq` once engine 0 holds the new weights, the
        sync's timings, and the sync commands of the other engines, which load from the same send.
        Timings: `seconds` (trainer 0's gather and send, plus what engine 0's load adds after it),
        `wait_s` (since `waited`, until engine 0 could start loading: the send, unless it
        streams or came before) and `load_s` (engine 0's load call)."""
        command = {"op": "sync", "version": version, "probe": self.probe}
        if transports.TRANSPORTS[self.sync.transport].streams:  # loaded as the buckets arrive
            others = self.fleet.send({**command, "handoff": None})  # every engine receives the one send
            start = time.perf_counter()
            self.llm.collective_rpc("hpcrl_load_weights",
                                    args=(transports.Handoff(self.sync.transport).as_dict(),))
            t0 = time.perf_counter()
            reply = self.plane.wait_reply(seq)
        else:
            reply = self.plane.wait_reply(seq)
            t0 = start = time.perf_counter()
            others = self.fleet.send({**command, "handoff": reply["handoff"]})
            self.llm.collective_rpc("hpcrl_load_weights", args=(reply["handoff"],))
        end = time.perf_counter()
        timings = {"seconds": reply["send_s"] + end - t0, "wait_s": start - waited, "load_s": end - start}
        return reply, timings, others
