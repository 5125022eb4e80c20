"""The hpcrl command line: doctor, config reference, and clear refusals instead of tracebacks."""

import subprocess
import sys


def hpcrl(*args):
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True, timeout=300)


def test_doctor_reports_versions_and_backends():
    out = hpcrl("doctor")
    assert out.returncode == 0, out.stderr
    for name in ("torch", "vllm", "deepspeed", "transformers", "submitit", "mlflow"):
        line = next(line for line in out.stdout.splitlines() if line.strip().startswith(name + " "))
        assert "MISSING" not in line
    assert "torch.distributed backend gloo" in out.stdout or "backend nccl" in out.stdout
    assert "sbatch" in out.stdout


def test_config_prints_every_section():
    out = hpcrl("config")
    assert out.returncode == 0
    for section in ("run", "model", "data", "algorithm", "generate", "reward", "update", "executor", "tracking"):
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
