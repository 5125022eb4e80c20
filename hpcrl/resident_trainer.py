"""A trainer rank of the resident job (hpcrl.resident): it keeps the update stage object (a live
DeepSpeed engine) for the run, updates on the generator's command, hands the weights it starts
from and each update's new weights to the engines, and commits each update (with its checkpoint
when due).

An update's weights go out when the generator asks for them (between two of its generations), or,
when the update command says `presend` (asynchronous generation over a transport that does not
stream: a shared buffer or files), as soon as the engines have loaded the previous ones out of that
buffer: the send then runs while the generator samples, not while it waits. Committing behind
(resident_sync.commits_behind), the weights go out as soon as the update's compute ends, before
its outputs are written; the probe under them (hpcrl.agreement) follows as a second part of the
reply, computed while the engines load."""

from __future__ import annotations

import collections
import os
import threading
import time
import traceback

from hpcrl import colocation, distributed, resident_sync, transports
from hpcrl.config import Experiment
from hpcrl.roles import ControlPlane
from hpcrl.rundir import RunDir
from hpcrl.stage import OpenStage
from hpcrl.stage_kinds import UPDATE


class Trainer:
    """A trainer rank: waits for update commands, updates, commits, and streams the weights."""

    def __init__(self, run: RunDir, exp: Experiment, plane: ControlPlane, rank: int):
        import torch
        import torch.distributed as dist

        from hpcrl.update import UpdateStage

        self.run, self.exp, self.plane, self.rank = run, exp, plane, rank
        setup = resident_sync.sync_setup(exp, run, plane, "trainer0") if rank == 0 else None
        world = exp.update.world_size
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(distributed.default_backend(torch.cuda.is_available()),
                                store=dist.PrefixStore("trainers", plane.store), rank=rank, world_size=world)
        # colocated with vLLM: the trainers' state leaves the GPU whenever vLLM is awake (hpcrl.colocation)
        self.colocated = exp.executor.resident.colocate
        if self.colocated and torch.cuda.is_available():
            colocation.check_device(exp, torch.cuda.current_device())
        self.stage = UpdateStage(exp, run, rank, world, resident=True)
        self.stage.setup(run.latest_saved_version())
        self.actor = self.stage.actor
        if self.colocated:
            self.actor.release()
            plane.signal(f"released/{rank}")  # vLLM starts into the memory only then
            if rank == 0:
                print("[resident] colocated: the trainers' state is in CPU memory whenever vLLM is awake",
                      flush=True)
        self.last_probe = None
        self.version = run.latest_saved_version()  # the policy version the trainers hold
        self.sends = 0  # the weight sends so far; the engines signal `loaded/<n>` once they hold send n
        self.committer: threading.Thread | None = None
        self.commit_error: BaseException | None = None
        self.sync = transports.make(setup) if setup is not None else None
        if self.sync is not None:
            device = str(self.actor.device) if resident_sync.backend() == "nccl" else "cpu"
            self.sync.open_sender(plane.store, device)

    def serve(self) -> None:
        import torch.distributed as dist

        while True:
            cmd = self.plane.receive()
            if cmd["op"] != "prepare" or self.exp.update.world_size > 1:
                self._await_commit()  # the previous update's commit ends before any new collective
            if cmd["op"] == "stop":
                break
            if cmd["op"] == "start":
                self._start(cmd["probe"])
                continue
            if cmd["op"] == "prepare":
                self._prepare(cmd["iteration"])
                continue
            self._update(cmd["iteration"], cmd["checkpoint"], cmd["probe"], cmd.get("presend", False))
        if self.sync is not None:
            self.sync.close()
        dist.destroy_process_group()

    def _start(self, probe: list[list[int]]) -> None:
        """Before the first iteration: the weights the trainers start from, sent to every engine
        (which started with none: hpcrl.resident_engines), and the probe under them (hpcrl.agreement)."""
        if self.colocated:
            self.actor.restore()
        self.last_probe = self.actor.sequence_logprobs(probe)
        reply = self._send_weights()
        if self.rank == 0:
            self.plane.reply({**reply, "logprobs": self.last_probe,
                              "attn_implementation": self.actor.attn_implementation})

    def _send_weights(self, k: int | None = None) -> dict:
        """The current weights, from trainer 0 to the engines (every rank takes part in each
        layer's gather under ZeRO-3): the handoff the engines load and the seconds it took. For
        the update of iteration `k`, the generator is told first (it wakes vLLM's weights)."""
        t0 = time.perf_counter()
        self.sends += 1
        # with LoRA: every weight (bases and adapters) at the start, only the adapters after an update
        if self.colocated:  # vLLM's weights wake beside the trainer's, with nothing else of it
            self.actor.release(keep_weights=True)
        weights = self.actor.checkpoint_weights("wire" if k is None else "adapters")
        reply = {}
        if self.sync is not None:  # trainer 0 sends
            self.plane.signal(f"sending/{'start' if k is None else k}")
            reply["handoff"] = self.sync.send(weights).as_dict()
        elif self.exp.update.zero_stage == 3 or self.exp.update.backend == "megatron":
            collections.deque(weights, maxlen=0)  # every rank takes part in each layer's gather
        if self.colocated:  # before the reply, after which vLLM's KV cache wakes
            self.actor.release()
        reply["send_s"] = time.perf_counter() - t0
        return reply

    def _prepare(self, k: int) -> None:
        """Update k's forward passes that need no scores, computed now (hpcrl.update_ahead), while
        the generator scores generation k; only under the weights update k starts from (the
        generator commands it after update k - 1: otherwise the update computes them itself)."""
        if self.version == k and not self.colocated:
            self.stage.prepare(k)

    def _update(self, k: int, checkpoint: bool, probe: list[list[int]], presend: bool = False) -> None:
        if self.colocated:  # vLLM sleeps through the update
            self.actor.restore()
        # the probe under the current weights: the previous update's "new", or computed once
        old = self.last_probe if self.last_probe is not None else self.actor.sequence_logprobs(probe)
        attempt = OpenStage(UPDATE, self.run.root, k, self.rank, self.exp.update.world_size, startup=0.0)

        def hand_over() -> None:
            """The new weights to the engines, then the probe under them (hpcrl.agreement) for
            the generator's check, which it makes once it has loaded them."""
            new = self.actor.sequence_logprobs(probe) if self.colocated else None  # before vLLM's turn
            self._send_update(k, presend)
            self.last_probe = new if new is not None else self.actor.sequence_logprobs(probe)
            if self.rank == 0:
                self.plane.reply({"probe_old": old, "probe_new": self.last_probe}, part="probe")

        if attempt.ctx is None:  # committed by an earlier attempt
            hand_over()
            if self.rank == 0:
                self.plane.signal(f"committed/{k}")
            return
        behind = resident_sync.commits_behind(self.exp, presend)
        # committing behind, the weights go out as soon as the update's compute ends: its outputs
        # are written, and committed with the checkpoint, while the generator loads and samples
        self.stage.after_compute = hand_over if behind else None
        attempt.run(self.stage.run)
        self.version = k + 1
        if not behind:
            self._commit(attempt, k, checkpoint)
            hand_over()
            return
        self.committer = threading.Thread(target=self._commit_in_background, args=(attempt, k, checkpoint),
                                          name="hpcrl-commit", daemon=True)
        self.committer.start()

    def _send_update(self, k: int, presend: bool) -> None:
        """Update k's weights to the engines once they may take them: every rank waits (no
        collective of the trainers is held meanwhile) until the generator is between two
        generations (with max_staleness > 0 that may be a whole generation away), or, presending,
        until the engines no longer read the buffer this send rewrites."""
        self.plane.wait_signal(f"loaded/{self.sends}" if presend else f"receive/{k}")
        reply = self._send_weights(k)
        if self.rank == 0:
            self.plane.reply(reply)

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
