"""The hpcrl command line: doctor, config reference, and clear refusals instead of tracebacks."""

import subprocess
import sys


def hpcrl(*args):
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_doctor_reports_versions_and_backends():
    out = hpcrl("doctor")
    assert out.returncode == 0, out.stderr
    for name in ("torch", "vllm", "deepspeed", "transformers", "submitit", "mlflow"):
        line = next(line for line in out.stdout.splitlines() if line.strip().startswith(name + " "))
        assert "MISSING" not in line
    assert "torch.distributed backend gloo" in out.stdout or "backend nccl" in out.stdout
    assert "sbatch" in out.stdout


def test_doctor_shows_the_gpus_this_task_sees():
    """pins: a task's GPU variables or devices left out of the report, or NCCL's version missing."""
    from hpcrl.doctor import gpu_lines

    env = {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_LOCALID": "1", "HOME": "/root"}
    lines = gpu_lines(env, [("NVIDIA H200", 150 << 30), ("NVIDIA H200", 150 << 30)], "2.21.5")
    assert lines == ["gpus (this task):", f"  {'CUDA_VISIBLE_DEVICES':<21} 2,3", f"  {'SLURM_LOCALID':<21} 1",
                     f"  {'cuda:0':<21} NVIDIA H200, 150.0 GiB", f"  {'cuda:1':<21} NVIDIA H200, 150.0 GiB",
                     f"  {'nccl':<21} 2.21.5"]
    assert gpu_lines({}, [], None)[-1] == "  no CUDA device visible: every stage runs on cpu"


def test_doctor_with_an_experiment_shows_its_placement_and_colocated_memory(write_experiment):
    """pins: `hpcrl doctor EXPERIMENT` ignoring the experiment, or a colocated layout shown as
    fitting a GPU it does not fit."""
    from hpcrl import config
    from hpcrl.doctor import plan_lines

    colocated = {"mode": "resident", "resident": {"colocate": True, "gpu_memory_gib": 80}}
    path = write_experiment("doc", update={"offload": "optimizer"}, executor=colocated)
    out = hpcrl("doctor", str(path))
    assert out.returncode == 0, out.stderr
    assert "placement:" in out.stdout
    assert "colocated on a GPU of 80.0 GiB: every phase fits" in out.stdout
    exp = config.with_overrides(config.load(path), {"executor.resident.gpu_memory_gib": 0.5}, "test")
    lines = plan_lines(exp)
    assert "  colocated on a GPU of 0.5 GiB: does not fit" in lines
    assert any(line.strip().startswith("executor.resident.colocate: generation:") for line in lines)


def test_config_prints_every_section():
    out = hpcrl("config")
    assert out.returncode == 0
    for section in ("run", "model", "data", "algorithm", "generate", "reward", "update", "executor",
                    "tracking"):
        assert f"[{section}]" in out.stdout


def test_submit_with_bad_config_exits_with_a_sentence_not_a_traceback(write_experiment):
    path = write_experiment(generate={"temperatur": 0.5})
    out = hpcrl("submit", str(path))
    assert out.returncode == 2
    assert f"error: {path}: invalid config:" in out.stderr
    assert "generate.temperatur: unknown key in [generate]" in out.stderr
    assert "Traceback" not in out.stderr


def test_resume_of_a_directory_that_is_not_a_run(tmp_path):
    out = hpcrl("resume", str(tmp_path))
    assert out.returncode == 2 and "not an hpcrl run directory" in out.stderr


def test_submit_set_overrides_keys_and_names_a_bad_one(write_experiment, tmp_path):
    import tomllib

    path = write_experiment("base")
    out = hpcrl("submit", str(path), "--dry-run", "--set", "run.name=sweep-2", "--set", "update.lr=3e-5",
                "--set", 'executor.kind="slurm"', "--set", "algorithm.loss_agg=seq-mean-token-mean")
    assert out.returncode == 0, out.stderr
    frozen = tomllib.loads((tmp_path / "runs" / "dry-runs" / "sweep-2" / "experiment.toml").read_text())
    assert not (tmp_path / "runs" / "sweep-2").exists()  # a dry run creates no run
    assert frozen["update"]["lr"] == 3e-5 and frozen["executor"]["kind"] == "slurm"
    assert frozen["algorithm"]["loss_agg"] == "seq-mean-token-mean"  # a bare string is taken as one
    assert not (tmp_path / "runs" / "base").exists()
    for bad, says in (("update.lrr=1", "update.lrr: unknown key in [update]"),
                      ("updat.lr=1", "updat.lr: unknown key"),
                      ("update.lr", "expected KEY=VALUE"), ("update.lr=fast", "update.lr")):
        out = hpcrl("submit", str(path), "--dry-run", "--set", bad)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, (bad, out.stderr)


def test_a_dry_run_leaves_an_existing_run_byte_identical(write_experiment, tmp_path):
    """Pins: `submit --dry-run` with a larger run.iterations renamed the run's final-validation
    iteration and re-froze its config (a later --set of the old value was then refused)."""
    from hpcrl import config, runs
    from tests.synthetic_run import make_run

    path = write_experiment("r")
    runs.prepare(config.load(path), str(path))
    run = make_run(tmp_path / "runs" / "r", iterations=2, rows=32, val_rows=8, group_size=4)

    def tree() -> dict:
        return {p.relative_to(run.root): (p.read_bytes() if p.is_file() else None)
                for p in sorted(run.root.rglob("*"))}

    before = tree()
    assert run.iteration_dir(2).exists()  # the final validation
    out = hpcrl("submit", str(path), "--dry-run", "--set", "run.iterations=4")
    assert out.returncode == 0, out.stderr
    assert f"the existing run {run.root} is left as it is" in out.stdout
    assert tree() == before
    assert "iterations = 4" in (tmp_path / "runs" / "dry-runs" / "r" / "experiment.toml").read_text()
    again = hpcrl("submit", str(path), "--dry-run", "--set", "run.iterations=2")
    assert again.returncode == 0, again.stderr
