"""Which GPUs each task of a job uses: the placement plan, and each task binding itself to it.

Slurm places a job's tasks in blocks (`--ntasks-per-node`): node n holds tasks n*t .. n*t+t-1, and
every task sees all of its node's GPUs (CUDA_VISIBLE_DEVICES lists them). The plan gives each
task its own GPUs: a trainer rank one, each engine `generate.tensor_parallel_size`, disjoint on
each node; with `executor.resident.colocate` the engine takes GPUs its node's trainers hold
(vLLM sleeps through each update). Before anything touches CUDA, each task narrows
CUDA_VISIBLE_DEVICES to its own GPUs (`bind`): inside the task they are cuda:0, cuda:1, ..., so
no two ranks of one NCCL communicator share a device and vLLM cannot start on a trainer's GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpcrl.config import Experiment
from hpcrl.roles import Layout
from hpcrl.stage_kinds import GENERATE, UPDATE


class PlacementError(ValueError):
    """The job's tasks do not fit on its GPUs; names the key and what was expected."""


@dataclass(frozen=True)
class Slot:
    task: int  # the task's global rank (SLURM_PROCID)
    role: str  # "trainer <rank>" or "generator"
    node: int  # the node's index in the job
    gpus: tuple[int, ...]  # indices among the node's GPUs


def layout(exp: Experiment) -> Layout:
    """The resident job's tasks by role and node (hpcrl.roles.Layout); a heterogeneous job's second
    component (the generator's node) follows the trainers' in task order."""
    ex = exp.executor
    nodes = ex.resident.nodes if ex.kind == "slurm" and ex.resident.generator is None else 1
    return Layout(exp.update.world_size, exp.generate.engines, nodes)


def resident_plan(tasks: Layout, tp: int, gpus_per_node: int, colocate: bool) -> list[Slot]:
    """The resident job's tasks (trainers and engines by node: hpcrl.roles.Layout) on nodes of
    `gpus_per_node` GPUs each: a trainer one GPU, an engine `tp`, disjoint; colocated, each engine
    takes GPUs its node's trainers hold. PlacementError if they do not fit."""
    used, engines_here = [0] * tasks.nodes, [0] * tasks.nodes
    slots = []
    for task in range(tasks.world_size):
        node = tasks.node(task)
        role, index = tasks.role(task)
        if role == "trainer":
            first, need = used[node], 1
        else:
            first, need = (engines_here[node] * tp if colocate else used[node]), tp
            engines_here[node] += 1
        if first + need > gpus_per_node:
            raise PlacementError(_does_not_fit(node, slots, f"{role} {index}", need, gpus_per_node, colocate))
        slots.append(Slot(task, f"{role} {index}", node, tuple(range(first, first + need))))
        used[node] = max(used[node], first + need)
    return slots


def _does_not_fit(node: int, slots: list[Slot], role: str, need: int, gpus: int, colocate: bool) -> str:
    held = sum(len(s.gpus) for s in slots if s.node == node)
    what = f"{held} GPU(s) for the trainers placed there and {need} for the {role}"
    if role.startswith("generator") and colocate:
        what = f"{need} GPU(s) for each of its engines (generate.tensor_parallel_size)"
    return (f"executor.resident.gpus_per_node: node {node} of the resident job needs {what}, but has "
            f"{gpus}; expected more GPUs per node, more nodes, or executor.resident.colocate = true")


def heterogeneous_plan(trainers: int, tp: int, nodes: int, gpus_per_node: int,
                       generator_gpus: int) -> list[Slot]:
    """The trainers on `nodes` nodes, one GPU each; the generator on a node of its own (node
    `nodes`, a second job component) with `generator_gpus` GPUs."""
    per_node = trainers // nodes
    if per_node > gpus_per_node:
        raise PlacementError(f"executor.resident.gpus_per_node: {per_node} trainers per node (update."
                             f"world_size = {trainers} over {nodes} nodes) need one GPU each, but a node has "
                             f"{gpus_per_node}")
    if tp > generator_gpus:
        raise PlacementError(f"executor.resident.generator.gpus_per_node: generate.tensor_parallel_size = "
                             f"{tp} needs {tp} GPUs, but the generator's node has {generator_gpus}")
    slots = [Slot(t, f"trainer {t}", t // per_node, (t % per_node,)) for t in range(trainers)]
    return [*slots, Slot(trainers, "generator 0", nodes, tuple(range(tp)))]


def plan(exp: Experiment) -> list[Slot] | None:
    """The resident job's placement on its GPUs (a Slurm job's nodes, or this machine for the local
    executor); None where there is none to make (CPU, the staged mode, whose jobs each use all of
    their GPUs)."""
    ex = exp.executor
    if ex.mode != "resident":
        return None
    r, w, tp = ex.resident, exp.update.world_size, exp.generate.tensor_parallel_size
    g = r.generator if ex.kind == "slurm" else None  # the local executor has one node
    if g is not None and (r.gpus_per_node or g.gpus_per_node):
        return heterogeneous_plan(w, tp, r.nodes, r.gpus_per_node, g.gpus_per_node)
    if g is None and r.gpus_per_node:
        return resident_plan(layout(exp), tp, r.gpus_per_node, r.colocate)
    return None


def staged_plans(exp: Experiment) -> dict[str, list[Slot]]:
    """The GPUs of each staged job's tasks (on Slurm, or on this machine for the local executor):
    the update's ranks one each (a rank selects its GPU by its local rank), vLLM its
    tensor-parallel group; PlacementError where a job has too few."""
    ex, plans = exp.executor, {}
    if ex.mode != "staged":
        return plans
    u, g = ex.update, ex.generate
    if u.gpus_per_node:
        per_node = exp.update.world_size // _nodes(ex, u)
        if per_node > u.gpus_per_node:
            raise PlacementError(f"executor.update.gpus_per_node: {per_node} update ranks per node (update."
                                 f"world_size = {exp.update.world_size} over {u.nodes} nodes) need one GPU "
                                 f"each, but a node has {u.gpus_per_node}")
        plans[UPDATE] = [Slot(r, f"trainer {r}", r // per_node, (r % per_node,))
                           for r in range(exp.update.world_size)]
    if g.gpus_per_node:
        tp, gpus = exp.generate.tensor_parallel_size, g.gpus_per_node * _nodes(ex, g)
        if tp > gpus:
            raise PlacementError(f"executor.generate.gpus_per_node: generate.tensor_parallel_size = {tp} "
                                 f"needs {tp} GPUs, but the generate job has {gpus}")
        plans[GENERATE] = [Slot(0, f"vLLM (TP {tp})", 0, tuple(range(tp)))]
    return plans


def _nodes(ex, resources) -> int:
    """A staged job's nodes: its own on Slurm, this machine alone with the local executor."""
    return resources.nodes if ex.kind == "slurm" else 1


def narrowed(visible: str | None, gpus: tuple[int, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for the node's GPUs `gpus` (indices among `visible`, what Slurm gave
    the node's tasks; all of the node's when unset)."""
    ids = visible.split(",") if visible else [str(i) for i in range(max(gpus) + 1)]
    return ",".join(ids[i] for i in gpus)


def bind(exp: Experiment, task: int) -> Slot | None:
    """Narrow this task's CUDA_VISIBLE_DEVICES to its slot's GPUs (before CUDA is initialised),
    set LOCAL_RANK to 0 (its first GPU), and make vLLM spawn its workers; the slot, if any."""
    slots = plan(exp)
    if slots is None:
        return None
    slot = slots[task]
    os.environ["CUDA_VISIBLE_DEVICES"] = narrowed(os.environ.get("CUDA_VISIBLE_DEVICES"), slot.gpus)
    os.environ["LOCAL_RANK"] = "0"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # workers of a process that saw CUDA
    return slot


def describe(exp: Experiment) -> str | None:
    """The placement of every job with GPUs, as a table for a person; None without GPUs."""
    slots = plan(exp)
    jobs = {"resident": slots} if slots is not None else staged_plans(exp)
    if not jobs:
        return None
    lines = [f"{'job':<9} {'task':>5}  {'role':<13} {'node':>4}  GPUs (of the node's)"]
    lines += [f"{job:<9} {s.task:>5}  {s.role:<13} {s.node:>4}  {','.join(map(str, s.gpus))}"
              for job, job_slots in jobs.items() for s in job_slots]
    return "\n".join(lines)


def bind_cpus(role: str, index: int = 0, setting: str | None = None) -> set[int] | None:
    """On a CPU node, pin this task to its role's cores when HPCRL_ROLE_CPUS names them
    ("trainer=0;generator=1", each a list like "0-3,8"; "generator1=..." for engine 1 alone), so
    each role owns its cores as it owns its GPUs on a GPU node (tools/bench_async.py,
    tools/bench_engines.py); the cores set, or None when not named."""
    setting = os.environ.get("HPCRL_ROLE_CPUS", "") if setting is None else setting
    named = dict(part.split("=", 1) for part in setting.split(";") if "=" in part)
    cores = named.get(f"{role}{index}") or named.get(role)
    if not cores:
        return None
    chosen = {c for span in cores.split(",") for c in _span(span)}
    os.sched_setaffinity(0, chosen)
    return chosen


def _span(text: str) -> range:
    lo, _, hi = text.partition("-")
    return range(int(lo), int(hi or lo) + 1)
