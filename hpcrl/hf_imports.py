"""transformers, imported without scikit-learn.

transformers imports scikit-learn at start-up whenever it is installed (MLflow installs it), for
the ROC curve of its assisted generation (transformers.generation.candidate_generator), which hpcrl
never runs: 1.2 s of the start of every process that imports transformers, on CPU (a vLLM engine,
a trainer, the pre-flight's tokenizer). `skip_scikit_learn` tells transformers that it is absent;
hpcrl calls it before each of these first imports transformers. scikit-learn itself stays
importable: a reward function may use it.
"""

from __future__ import annotations

import sys


def skip_scikit_learn() -> None:
    """transformers told that scikit-learn is absent, before its generation utilities load (once
    they have, too late: nothing is changed)."""
    if "transformers.generation" in sys.modules:
        return
    from transformers import utils
    from transformers.utils import import_utils

    def absent() -> bool:
        return False

    utils.is_sklearn_available = import_utils.is_sklearn_available = absent
