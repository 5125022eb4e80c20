"""The resident mode: one job keeps the trainer ranks, the vLLM generator and the reward workers
up for the whole run, and moves new weights from the trainer to vLLM without a restart.

Task layout (hpcrl.roles.Layout): trainer ranks 0..W-1 each set up the update stage object once
(hpcrl.update.UpdateStage: a live DeepSpeed engine); task W sets up the generate and score stage
objects once (the vLLM engine, the pool of reward workers) and drives the loop. It walks the same
plan as the staged controller (hpcrl.plan) and runs each stage object through
hpcrl.stage.run_stage, so a resident run commits exactly the outputs of a staged one and can be
resumed, inspected, replayed, or continued in the other mode.

For the update of iteration k the generator sends a command; the trainers run the update, and
trainer 0 hands the weights over through the transport `executor.resident.weight_sync` names
(hpcrl.transports: a process group, a shared-memory file on one node, or the filesystem), for the
generator's vLLM workers to load in place (hpcrl.vllm_ext). Then both sides compute
logprobs of a fixed probe batch: a mismatch stops the run (hpcrl.weight_sync.check_probe).
The trainers commit the update (with the policy and trainer state every
`executor.resident.checkpoint_every` updates) in the background while the generator samples the next
batch (`executor.resident.overlap_commit`); that generation commits only once the update it depends on
has, so the run directory never holds a stage whose input is not committed.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback

import submitit

from hpcrl import distributed, placement, plan, requeue, transports, weight_sync
from hpcrl.config import Experiment
from hpcrl.roles import HEARTBEAT_S, ControlPlane, Layout, job_secret
from hpcrl.rundir import RunDir
from hpcrl.stage import OpenStage, run_stage
from hpcrl.stage_kinds import UPDATE

PROBE_PROMPTS = 4


def checkpoint_due(exp: Experiment, iteration: int) -> bool:
    """Whether the update of `iteration` saves the policy and trainer state."""
    every = exp.executor.resident.checkpoint_every
    return (iteration + 1) % every == 0 or iteration + 1 == exp.run.iterations


def probe_sequences(exp: Experiment, tokenizer) -> list[list[int]]:
    """Fixed token sequences (the first training prompts and their answers) both sides score."""
    from hpcrl import data

    prompts = data.prompt_set(exp, "train", tokenizer).table
    out = []
    for i in range(min(PROBE_PROMPTS, prompts.num_rows)):
        text = data.render(tokenizer, prompts["prompt"][i].as_py()) + str(prompts["ground_truth"][i].as_py())
        out.append(tokenizer(text)["input_ids"][: exp.model.max_model_len])
    return out


def _sync_setup(exp: Experiment, run: RunDir, plane: ControlPlane, me: str,
                peer: str) -> transports.SyncSetup:
    """The weight sync both ends agree on (hpcrl.transports), from where trainer 0 and the generator run."""
    here = os.environ.get("SLURMD_NODENAME") or os.uname().nodename  # Slurm's node name, else the host's
    plane.put(plane.store, f"host/{me}", here)
    hosts = {me: here, peer: plane.wait_for(f"host/{peer}")}
    r = exp.executor.resident
    name = transports.choose(r.weight_sync, hosts["trainer0"], hosts["generator"], _backend() == "nccl")
    return transports.SyncSetup(name, plane.host, plane.port, engines=1,
                                tp=exp.generate.tensor_parallel_size, timeout_s=r.collective_timeout_s,
                                bucket_bytes=int(r.sync_bucket_mb * (1 << 20)), backend=_backend(),
                                directory=str(run.root / "resident" / "weights"))


def _backend() -> str:
    """The weight sync's backend (it moves the trainer's device tensors)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class ResidentCall(submitit.helpers.Checkpointable):
    """Every task of the resident job runs this; its global rank decides its role. Requeued
    (preemption, time limit), the job continues from the run directory."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> None:
        from hpcrl import runs

        distributed.export_env()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run, exp = runs.open_run(self.run_dir)
        placement.bind(exp, rank)  # this task's own GPUs, before anything touches CUDA
        layout = Layout(exp.update.world_size)
        if world != layout.world_size:
            raise RuntimeError(f"the resident job has {world} tasks; update.world_size = "
                               f"{exp.update.world_size} needs {layout.world_size} (trainers + 1 generator)")
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "local"
        secret = job_secret(run.root / "resident" / "keys" / f"{job}.key")  # only this job's tasks read it
        r = exp.executor.resident
        plane = ControlPlane(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, layout,
                             r.stall_s, r.collective_timeout_s, secret)
        plane.start_monitor()
        role, role_rank = layout.role(rank)
        try:
            if role == "trainer":
                Trainer(run, exp, plane, role_rank).serve()
            else:
                Generator(run, exp, plane).drive()
        except BaseException as err:
            if _lost_peer(err):  # a peer died mid-transfer: let the monitor name it (it ends this process)
                time.sleep(exp.executor.resident.stall_s + 2 * HEARTBEAT_S)
            plane.fail(f"{type(err).__name__}: {err}".splitlines()[0] + f" (on {os.uname().nodename})")
            traceback.print_exc()
            time.sleep(2 * HEARTBEAT_S)  # the other tasks' monitors read the flag before rank 0's store goes
            raise


def _lost_peer(err: BaseException) -> bool:
    """Whether an error is a broken connection to another task (gloo, NCCL or the store)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "closed by peer",
                            "timed out"))


class Trainer:
    """A trainer rank: waits for update commands, updates, commits, and streams the weights."""

    def __init__(self, run: RunDir, exp: Experiment, plane: ControlPlane, rank: int):
        import torch
        import torch.distributed as dist

        from hpcrl.update import UpdateStage

        self.run, self.exp, self.plane, self.rank = run, exp, plane, rank
        setup = _sync_setup(exp, run, plane, "trainer0", "generator") if rank == 0 else None
        world = exp.update.world_size
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(distributed.default_backend(torch.cuda.is_available()),
                                store=dist.PrefixStore("trainers", plane.store), rank=rank, world_size=world)
        self.stage = UpdateStage(exp, run, rank, world, resident=True)
        self.stage.setup(run.latest_saved_version())
        self.actor = self.stage.actor
        self.last_probe = None
        self.committer: threading.Thread | None = None
        self.commit_error: BaseException | None = None
        self.sync = transports.make(setup) if setup is not None else None
        if self.sync is not None:
            self.sync.open_sender(plane.store,
                                  str(self.actor.engine.device) if _backend() == "nccl" else "cpu")

    def serve(self) -> None:
        import torch.distributed as dist

        while True:
            cmd = self.plane.receive()
            self._await_commit()  # the previous update's commit ends before any new collective
            if cmd["op"] == "stop":
                break
            if cmd["op"] == "probe":  # before the first iteration (hpcrl.agreement)
                self.last_probe = self.actor.sequence_logprobs(cmd["probe"])
                if self.rank == 0:
                    self.plane.reply({"logprobs": self.last_probe,
                                      "attn_implementation": self.actor.attn_implementation})
                continue
            self._update(cmd["iteration"], cmd["checkpoint"], cmd["probe"])
        dist.destroy_process_group()

    def _update(self, k: int, checkpoint: bool, probe: list[list[int]]) -> None:
        # the probe under the current weights: the previous update's "new", or computed once
        old = self.last_probe if self.last_probe is not None else self.actor.sequence_logprobs(probe)
        attempt = OpenStage(UPDATE, self.run.root, k, self.rank, self.exp.update.world_size, startup=0.0)
        overlap = self.exp.executor.resident.overlap_commit
        if attempt.ctx is not None:
            attempt.run(self.stage.run)
            if not overlap:
                self._commit(attempt, k, checkpoint)
        new = self.last_probe = self.actor.sequence_logprobs(probe)
        t0 = time.perf_counter()
        reply = {"probe_old": old, "probe_new": new}
        weights = self.actor.checkpoint_weights()
        if self.sync is not None:  # trainer 0 sends
            self.plane.signal(f"sending/{k}")  # the generator wakes its weights and posts its receive now
            reply["handoff"] = self.sync.send(weights).as_dict()
        elif self.exp.update.zero_stage == 3:  # the others take part in each layer's gather
            collections.deque(weights, maxlen=0)
        reply["send_s"] = time.perf_counter() - t0
        if self.rank == 0:
            self.plane.reply(reply)
        if attempt.ctx is None and self.rank == 0:  # committed by an earlier attempt
            self.plane.signal(f"committed/{k}")
        elif attempt.ctx is not None and overlap:
            # the checkpoint and the commit run while the generator samples
            self.committer = threading.Thread(target=self._commit_in_background,
                                              args=(attempt, k, checkpoint), name="hpcrl-commit", daemon=True)
            self.committer.start()

    def _commit(self, attempt: OpenStage, k: int, checkpoint: bool) -> None:
        """The update's outputs (with the policy and trainer state when due) committed; the
        generator told, for the generation that records this update as its input."""
        if checkpoint:
            attempt.run(self.actor.save)
        attempt.commit()
        if self.rank == 0:
            self.plane.signal(f"committed/{k}")

    def _commit_in_background(self, attempt: OpenStage, k: int, checkpoint: bool) -> None:
        try:
            self._commit(attempt, k, checkpoint)
        except BaseException as err:  # noqa: BLE001  (every task stops: the monitors read the flag)
            self.commit_error = err
            traceback.print_exc()
            self.plane.fail(f"committing the update of iteration {k}: {type(err).__name__}: "
                            f"{err}".splitlines()[0])

    def _await_commit(self) -> None:
        if self.committer is not None:
            self.committer.join()
            self.committer = None
        if self.commit_error is not None:
            raise RuntimeError("the previous update's commit failed") from self.commit_error


class Generator:
    """The generator task: the generate and score stage objects (vLLM engine, reward pool), and
    the loop over the run's stages."""

    def __init__(self, run: RunDir, exp: Experiment, plane: ControlPlane):
        from hpcrl.generation import GenerateStage
        from hpcrl.scoring import ScoreStage

        self.run, self.exp, self.plane = run, exp, plane
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)  # vLLM sets up its own (single-process) distributed state
        self.gen, self.score = GenerateStage(exp, run, resident=True), ScoreStage(exp, run, resident=True)
        self.gen.startup()
        self.sync = _sync_setup(exp, run, plane, "generator", "trainer0")
        self.gen.setup(run.latest_saved_version(), exp.run.seed)
        self.llm = self.gen.llm
        self.llm.collective_rpc("hpcrl_open_sync", args=(self.sync.as_dict(), 0))
        print(f"[resident] weights reach vLLM through {self.sync.transport.replace('_', ' ')}", flush=True)
        self.score.setup(self.gen.version, exp.run.seed)
        self.gen.pool = self.score.pool  # dynamic sampling scores its rounds on the same workers
        self.probe = probe_sequences(exp, self.llm.get_tokenizer())
        self.committing: int | None = None  # the update the trainers may still be committing

    def drive(self) -> None:
        stages = {s.name: s for s in (self.gen, self.score)}  # the update runs on the trainers
        try:
            self._check_agreement()
            while (nxt := self._next_stage()) is not None:
                k, name = nxt
                if name not in stages:
                    self._update(k)
                    continue
                self.gen.await_policy = self._await_commit if self.committing is not None else None
                run_stage(name, self.run.root, k, stages[name].run, startup=0.0)
            self._await_commit()
        finally:
            self.score.close()
        self.plane.send({"op": "stop"})
        self.plane.stop_monitor()

    def _check_agreement(self) -> None:
        """Before any iteration: the trainer and vLLM, holding the same weights, must compute the
        same probe logprobs (hpcrl.agreement.check_start)."""
        from hpcrl import agreement, generation

        reply = self.plane.wait_reply(self.plane.send({"op": "probe", "probe": self.probe}))
        tol = weight_sync.probe_tolerance(self.exp.executor.resident.sync_check_tol, self.exp.model.dtype)
        metrics = agreement.check_start(generation.sequence_logprobs(self.llm, self.probe), reply["logprobs"],
                                        tol, reply["attn_implementation"], self.exp.model.path)
        print(f"[resident] trainer and vLLM agree on the probe: {metrics['sync/start_logp_diff']:.1e} "
              f"(tolerance {tol:.0e})", flush=True)
        self.gen.metrics = metrics  # in the next generation's manifest
        self.noise = metrics["sync/start_logp_diff"]  # what the probe cannot resolve (check_probe)

    def _next_stage(self) -> tuple[int, str] | None:
        """The next stage to run: the first uncommitted one, but for the update being committed."""
        pending = [s for s in plan.pending_stages(self.run, self.exp) if s != (self.committing, UPDATE)]
        return pending[0] if pending else None

    def _await_commit(self) -> None:
        """Until the trainers have committed the update whose policy the engine holds."""
        if self.committing is not None:
            self.plane.wait_signal(f"committed/{self.committing}")
            self.committing = None

    def _update(self, k: int) -> None:
        colocate = self.exp.executor.resident.colocate and _backend() == "nccl"
        if colocate:  # free vLLM's GPU memory (weights and KV cache) for the update
            self.llm.sleep(level=2)
        seq = self.plane.send({"op": UPDATE, "iteration": k, "checkpoint": checkpoint_due(self.exp, k),
                               "probe": self.probe})
        # through the update on the control plane: vLLM's weights stay asleep, and its receive is
        # posted only when trainer 0 sends (not under the NCCL watchdog for the whole update)
        self.plane.wait_signal(f"sending/{k}")
        if colocate:
            self.llm.wake_up(tags=["weights"])
        reply, sync_s = self._load_weights(seq)
        if colocate:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.gen.version = k + 1
        self.committing = k if self.exp.executor.resident.overlap_commit else None
        from hpcrl import generation

        t0 = time.perf_counter()
        engine_lp = generation.sequence_logprobs(self.llm, self.probe)
        tol = weight_sync.probe_tolerance(self.exp.executor.resident.sync_check_tol, self.exp.model.dtype)
        metrics = weight_sync.check_probe(engine_lp, reply["probe_new"], reply["probe_old"], tol,
                                          version=k + 1, noise=getattr(self, "noise", None))
        metrics["sync/probe_s"] = time.perf_counter() - t0
        nbytes = float(reply["handoff"]["bytes"])
        self.gen.metrics = {**metrics, "sync/seconds": sync_s, "sync/bytes": nbytes,
                            "sync/gb_per_s": nbytes / max(sync_s, 1e-9) / 1e9}

    def _load_weights(self, seq: int) -> tuple[dict, float]:
        """The trainer's reply to update command `seq`, once the engine holds the new weights, and
        the sync's seconds: trainer 0's gather and send, plus what the load side adds after it."""
        if transports.TRANSPORTS[self.sync.transport].streams:  # loaded as the buckets arrive
            self.llm.collective_rpc("hpcrl_load_weights",
                                    args=(transports.Handoff(self.sync.transport).as_dict(),))
            t0 = time.perf_counter()
            reply = self.plane.wait_reply(seq)
        else:
            reply = self.plane.wait_reply(seq)
            t0 = time.perf_counter()
            self.llm.collective_rpc("hpcrl_load_weights", args=(reply["handoff"],))
        return reply, reply["send_s"] + time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """`srun python -m hpcrl.resident --run-dir R`: one task of a resident job started by hand."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hpcrl.resident", description=main.__doc__)
    parser.add_argument("--run-dir", required=True)
    run_dir = parser.parse_args(argv).run_dir
    requeue.install_by_hand(run_dir)
    ResidentCall(run_dir)()


if __name__ == "__main__":
    main()
