"""transformers, as hpcrl's processes import it, leaves scikit-learn out (hpcrl.hf_imports)."""

from __future__ import annotations

import subprocess
import sys

PROCESS = """
import sys
from hpcrl import config, data, generation
exp = config.load(sys.argv[1])
{first}
from vllm import LLM
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
print(sorted(m for m in ("sklearn", "transformers.generation", "vllm.entrypoints.llm") if m in sys.modules))
import sklearn.metrics
print("importable")
"""


def _modules(experiment, first: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROCESS.format(first=first), str(experiment)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("\n")[-3:-1]


def test_a_generate_job_and_a_preflight_load_transformers_without_scikit_learn(write_experiment):
    """vLLM's engine (generation.configure_env comes first) and the pre-flight's tokenizer: both
    import transformers' generation utilities, not scikit-learn, which a reward may still import."""
    path = write_experiment()
    want = ["['transformers.generation', 'vllm.entrypoints.llm']", "importable"]
    assert _modules(path, "generation.configure_env(exp.generate)") == want
    assert _modules(path, "data.load_tokenizer(exp)") == want
    # a process that never calls it imports scikit-learn with transformers
    assert _modules(path, "")[0] == "['sklearn', 'transformers.generation', 'vllm.entrypoints.llm']"
