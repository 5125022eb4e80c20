"""The resident mode: one job keeps the trainer ranks, the vLLM generator and the reward workers
up for the whole run, and moves new weights from the trainer to vLLM without a restart.

Task layout (hpcrl.roles.Layout): the W trainer ranks each set up the update stage object once
(hpcrl.resident_trainer: a live DeepSpeed engine); generator 0 sets up the generate and score
stage objects once (its vLLM engine, the pool of reward workers) and drives the loop
(hpcrl.resident_generator); with generate.engines = N, generators 1..N-1 each hold an engine of
their own and serve generator 0's commands (hpcrl.resident_engines). Generator 0 walks the same
plan as the staged controller (hpcrl.plan) and runs each stage object through
hpcrl.stage.run_stage, so a resident run commits exactly the outputs of a staged one and can be
resumed, inspected, replayed, or continued in the other mode.

For the update of iteration k the generator sends a command; the trainers run the update, and when
the generator asks for that version (between two generations), trainer 0 hands the weights over
through the transport `executor.resident.weight_sync` names (hpcrl.transports: a process group, a
shared-memory file on one node, or the filesystem) in one send that reaches every engine, for
their vLLM workers to load in place (hpcrl.vllm_ext). Then each engine and the trainer compute
logprobs of a fixed probe batch: a mismatch stops the run (hpcrl.weight_sync.check_probe). In
lock-step (algorithm.max_staleness = 0) the trainers commit the update (with the policy and trainer
state every `executor.resident.checkpoint_every` updates) in the background while the generator
samples the next batch (`executor.resident.overlap_commit`); with staleness the next generations
overlap the update itself, and the commit follows the send where trainer 0 sends as soon as the
update ends (hpcrl.resident_sync.commits_behind).
A generation commits only once the update it depends on has, so the run directory never holds a
stage whose input is not committed.
"""

from __future__ import annotations

import gc
import os
import time
import traceback

import submitit

from hpcrl import distributed, placement, requeue, stage
from hpcrl.roles import HEARTBEAT_S, ControlPlane, job_secret


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
        layout = placement.layout(exp)
        if world != layout.world_size:
            raise RuntimeError(f"the resident job has {world} tasks; update.world_size = "
                               f"{exp.update.world_size} and generate.engines = {exp.generate.engines} "
                               f"need {layout.world_size}")
        role, role_rank = layout.role(rank)
        placement.bind_cpus(role, role_rank)  # before any thread starts (threads keep their cores)
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "local"
        secret = job_secret(run.root / "resident" / "keys" / f"{job}.key")  # only this job's tasks read it
        r = exp.executor.resident
        plane = ControlPlane(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, layout,
                             r.stall_s, r.collective_timeout_s, secret)
        plane.start_monitor()
        try:
            if role == "trainer":
                from hpcrl.resident_trainer import Trainer

                task = Trainer(run, exp, plane, role_rank).serve
            elif role_rank == 0:
                from hpcrl.resident_generator import Generator

                task = Generator(run, exp, plane).drive
            else:
                from hpcrl.resident_engines import Engine

                task = Engine(run, exp, plane, role_rank).serve
            gc.freeze()  # the start-up's heap (imports, model, engine): no full collection walks it again
            task()
            plane.close()
            stage.skip_final_collection()
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
