"""The private names of Lightning, Accelerate, transformers and TRL, and the writes to their
objects (a process-wide swap of a function, their state rewritten), live in
``tapesac_lightning/_compat.py`` alone, and the versions ``pyproject.toml`` allows for each
library are those the integrations were checked on (``_compat.CHECKED``)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import textwrap
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from tapesac_lightning import _compat
from tapesac_lightning._compat import CHECKED

ROOT = Path(__file__).resolve().parent.parent
# The libraries, by top-level module name (Lightning's family: the packages it is built from).
LIBRARIES = (
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "trl",
)
# Private attributes of the libraries' objects the integrations reached before they moved into
# _compat, on objects a scan cannot trace to its library (a parameter, a model's class).
LIBRARY_ATTRIBUTES = {"_batches_that_stepped", "_data_parallel_size", "_no_split_modules"}
ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}

Inherited = Callable[[str], set[str]]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _library(module: str) -> bool:
    return module.partition(".")[0] in LIBRARIES


def _bindings(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds to a library object, and that object's dotted path."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _library(alias.name):
                    top = alias.name.partition(".")[0]
                    bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and not node.level and _library(node.module or ""):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _path(node: ast.expr, bound: dict[str, str]) -> str | None:
    """The library object's dotted path an expression names (``pl.Trainer``:
    ``lightning.pytorch.Trainer``), None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def _chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """The name an expression starts from and the attributes it reaches from there, through
    calls and subscripts (``PartialState().distributed_type``: ``PartialState``, its
    ``distributed_type``)."""
    attributes = []
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attributes.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return (node.id if isinstance(node, ast.Name) else None), attributes[::-1]


class _Scan(ast.NodeVisitor):
    """What ``library_privates`` finds, visiting with the class and function around each node."""

    def __init__(self, bound: dict[str, str], inherited: Inherited) -> None:
        self.bound, self.inherited = bound, inherited
        self.found: set[tuple[int, str]] = set()
        self.held: set[str] = set()  # names holding a library object in the functions around
        self.theirs: set[str] | None = None  # the library base's private names, in a subclass
        self.own: set[str] = set()  # what such a subclass sets on self or defines itself

    def library(self, node: ast.expr) -> bool:
        """Whether ``node`` is a library object: an import, a name holding one, or what a subclass
        of a library class reaches through self that it did not set itself."""
        root, attributes = _chain(node)
        if root in self.bound or root in self.held:
            return True
        derived = self.theirs is not None and root in ("self", "cls")
        return derived and bool(attributes) and attributes[0] not in self.own

    def inherited_name(self, node: ast.expr, name: str) -> bool:
        """``self.<name>`` for one of the library base's private names, in a subclass."""
        own_object = isinstance(node, ast.Name) and node.id in ("self", "cls")
        return own_object and self.theirs is not None and name in self.theirs

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _library(alias.name) and any(_private(p) for p in alias.name.split(".")):
                self.found.add((node.lineno, alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not _library(node.module or ""):
            return
        assert node.module is not None
        if any(_private(p) for p in node.module.split(".")):
            self.found.add((node.lineno, node.module))
        self.found |= {(node.lineno, a.name) for a in node.names if _private(a.name)}

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        saved = self.theirs, self.own
        bases = [p for p in (_path(b, self.bound) for b in node.bases) if p is not None]
        self.theirs = set().union(*map(self.inherited, bases)) if bases else None
        self.own = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
        }
        self.generic_visit(node)
        self.theirs, self.own = saved

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        saved = self.held
        arguments = node.args
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            if arg.annotation is not None and any(
                isinstance(n, (ast.Name, ast.Attribute)) and _path(n, self.bound)
                for n in ast.walk(arg.annotation)
            ):
                self.held = self.held | {arg.arg}  # annotated with a library type
        # And the names assigned an attribute of one (state = accelerator.state), not what a
        # call returns (a parser, a namespace: handed over, no library's state).
        for _ in range(2):
            for inner in ast.walk(node):
                target = inner.targets[0] if isinstance(inner, ast.Assign) else None
                if isinstance(inner, ast.AnnAssign) and inner.value is not None:
                    target = inner.target
                value = getattr(inner, "value", None)
                if isinstance(target, ast.Name) and isinstance(value, ast.expr):
                    called = any(isinstance(n, ast.Call) for n in ast.walk(value))
                    if not called and self.library(value):
                        self.held = self.held | {target.id}
        self.generic_visit(node)
        self.held = saved

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        library = self.library(node.value)
        if _private(node.attr) and (
            library or node.attr in LIBRARY_ATTRIBUTES or self.inherited_name(node.value, node.attr)
        ):
            self.found.add((node.lineno, node.attr))
        if isinstance(node.ctx, (ast.Store, ast.Del)) and library:
            self.found.add((node.lineno, f"{ast.unparse(node)} written"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Name) and function.id in ATTRIBUTE_BUILTINS:
            target, name = (node.args + [None, None])[:2]
            constant = name.value if isinstance(name, ast.Constant) else None
            if isinstance(target, ast.expr) and isinstance(constant, str) and _private(constant):
                if (
                    self.library(target)
                    or constant in LIBRARY_ATTRIBUTES
                    or self.inherited_name(target, constant)
                ):
                    self.found.add((node.lineno, constant))
            if function.id in ("setattr", "delattr") and isinstance(target, ast.expr):
                if self.library(target):
                    written = constant if isinstance(constant, str) else "*"
                    self.found.add((node.lineno, f"{ast.unparse(target)}.{written} written"))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in LIBRARY_ATTRIBUTES:
            self.found.add((node.lineno, node.value))


def library_privates(
    source: str, inherited: Inherited = lambda path: set()
) -> list[tuple[int, str]]:
    """(line, what) for each private name of the libraries that ``source`` reaches, and each
    attribute of their objects it writes.

    Private: an import of a private name or module; a private attribute of a library object (an
    import, ``pl._x``; a parameter annotated with a library type, or a name assigned one; in a
    subclass of a library class, what it reaches through self that it did not set); one of
    ``LIBRARY_ATTRIBUTES`` on anything (``getattr(model, "_no_split_modules")`` too); in such a
    subclass, ``self._x`` for a private name of the library class (``inherited`` of its dotted
    path gives those). Written: an attribute of a library object assigned, deleted or set with
    ``setattr`` (``model_parallel.is_overridden = ...``: a process-wide swap;
    ``PartialState().distributed_type = ...``; ``setattr(args, name, False)``)."""
    tree = ast.parse(source)
    scan = _Scan(_bindings(tree), inherited)
    scan.visit(tree)
    return sorted(scan.found)


@cache
def inherited_privates(path: str) -> set[str]:
    """The private names the library class at ``path`` and its library bases define or set on
    ``self`` (read from their source); empty for anything not a class of an installed library."""
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return set()
    if not isinstance(cls, type):
        return set()
    found = set()
    for klass in cls.__mro__:
        if not _library(klass.__module__):
            continue
        found |= {n for n in vars(klass) if _private(n)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        found |= {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
            and _private(n.attr)
        }
    return found


def test_the_check_finds_each_kind_of_library_private_and_write() -> None:
    code = (
        "import lightning.pytorch as pl\n"
        "from lightning.pytorch.strategies import ModelParallelStrategy\n"
        "from lightning.pytorch.strategies import model_parallel as mp\n"
        "from lightning.fabric.utilities.init import _materialize_distributed_module\n"
        "import transformers.utils._private\n"
        "mp.is_overridden = lambda name, *args: True\n"
        "class Strategy(ModelParallelStrategy):\n"
        "    def setup_environment(self) -> None:\n"
        "        if self._tensor_parallel_size == 'auto':\n"
        "            self._own = self.world_size\n"
        "        self.mesh._rank = self._own\n"
        "def connector(trainer: pl.Trainer) -> object:\n"
        "    loop = trainer.fit_loop\n"
        "    loop.epoch_loop.done = True\n"
        "    return trainer._accelerator_connector\n"
        'no_split = set(getattr(model, "_no_split_modules", None) or ())\n'
        "pl._version\n"
        "setattr(mp, 'is_overridden', None)\n"
    )

    def inherited(path: str) -> set[str]:
        assert path == "lightning.pytorch.strategies.ModelParallelStrategy"
        return {"_tensor_parallel_size", "_data_parallel_size"}

    assert library_privates(code, inherited) == [
        (4, "_materialize_distributed_module"),
        (5, "transformers.utils._private"),
        (6, "mp.is_overridden written"),
        (9, "_tensor_parallel_size"),
        (11, "_rank"),
        (11, "self.mesh._rank written"),
        (14, "loop.epoch_loop.done written"),
        (15, "_accelerator_connector"),
        (16, "_no_split_modules"),
        (17, "_version"),
        (18, "mp.is_overridden written"),
    ]


def test_the_check_finds_each_workaround_the_integrations_had() -> None:
    """Each offence of the integrations before _compat, in their words (abridged)."""
    code = (
        "from accelerate import Accelerator, PartialState\n"
        "from lightning.pytorch.strategies import ModelParallelStrategy\n"
        "from lightning.pytorch.strategies import model_parallel as _model_parallel\n"
        "from transformers import TrainingArguments\n"
        "class TapeSACFSDPStrategy(ModelParallelStrategy):\n"
        "    def _data_parallel_over_every_process(self) -> None:\n"
        '        if self._data_parallel_size == "auto":\n'
        "            self._data_parallel_size = self.world_size\n"
        "def _configure_model_not_required():\n"
        "    original = _model_parallel.is_overridden\n"
        "    _model_parallel.is_overridden = lambda name, *a, **k: True\n"
        "def _log_step(trainer):\n"
        "    return trainer.fit_loop.epoch_loop._batches_that_stepped\n"
        "def use_fsdp_on_cpu(accelerator: Accelerator, plugin) -> None:\n"
        "    state = accelerator.state\n"
        "    state.distributed_type = DistributedType.FSDP\n"
        "    PartialState().distributed_type = DistributedType.FSDP\n"
        "class TapeSACAccelerator(Accelerator):\n"
        "    def prepare(self, *args):\n"
        "        self.state.fsdp_plugin.activation_checkpointing = False\n"
        "def _switch_off_trainer_checkpointing(args: TrainingArguments) -> None:\n"
        "    for name in ('activation_checkpointing', 'gradient_checkpointing'):\n"
        "        setattr(args, name, False)\n"
        "def _select(model, present):\n"
        '    return set(getattr(model, "_no_split_modules", None) or ()) & present\n'
    )
    assert [(line, what) for line, what in library_privates(code, inherited_privates)] == [
        (7, "_data_parallel_size"),
        (8, "_data_parallel_size"),
        (11, "_model_parallel.is_overridden written"),
        (13, "_batches_that_stepped"),
        (16, "state.distributed_type written"),
        (17, "PartialState().distributed_type written"),
        (20, "self.state.fsdp_plugin.activation_checkpointing written"),
        (23, "args.* written"),
        (25, "_no_split_modules"),
    ]


def test_the_check_passes_public_reads_own_names_and_objects_handed_over() -> None:
    code = (
        "import lightning.pytorch as pl\n"
        "from accelerate.commands.launch import launch_command_parser\n"
        "from transformers import TrainerCallback, TrainingArguments\n"
        "class Callback(TrainerCallback):\n"
        "    def __init__(self) -> None:\n"
        "        self._writer = Writer()\n"
        "        self._writer.step = 0\n"
        "    def on_init_end(self, args: TrainingArguments) -> None:\n"
        "        self._on = args.gradient_checkpointing\n"
        "        self._kind = args.__class__\n"
        "def step(trainer: pl.Trainer) -> int:\n"
        "    return trainer.global_step\n"
        "def launch() -> None:\n"
        "    parser = launch_command_parser()\n"
        "    parser.prog = 'tapesac launch'\n"
        "from ._compat import logged_step\n"
    )
    assert library_privates(code, lambda path: {"_internal"}) == []


def test_library_privates_are_reached_only_in_compat() -> None:
    found = []
    for path in sorted((ROOT / "tapesac_lightning").rglob("*.py")):
        if path.name == "_compat.py":
            continue
        rel = path.relative_to(ROOT).as_posix()
        privates = library_privates(path.read_text(), inherited_privates)
        found += [f"{rel}:{line} {what}" for line, what in privates]
    assert not found, (
        "private names or patches of Lightning, Accelerate, transformers or TRL outside "
        "tapesac_lightning/_compat.py:\n" + "\n".join(found)
    )


def test_each_workaround_says_what_it_works_around_and_where_it_was_checked() -> None:
    names = [n for n in _compat.__all__ if n != "CHECKED"]
    defined = [
        n
        for n, f in vars(_compat).items()
        if inspect.isfunction(f) and f.__module__ == _compat.__name__ and not _private(n)
    ]
    assert names == sorted(defined)
    for name in names:
        doc = inspect.getdoc(getattr(_compat, name)) or ""
        assert "Works around" in doc and "Checked on" in doc, name
        checked = re.search(r"Checked on (\w+)", doc)
        assert checked is not None and checked.group(1).lower() in CHECKED, name


def _bounds(text: str, library: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The one ``>=low,<high`` every requirement of ``library`` in pyproject's optional
    dependencies gives."""
    section = text.split("\n[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    requirements = set(re.findall(rf'"{library}((?:[<>=!~][^"]*)?)"', section))
    assert len(requirements) == 1, f"{library}: {sorted(requirements)} (want one, bounded)"
    (requirement,) = requirements
    match = re.fullmatch(r">=([\d.]+),<([\d.]+)", requirement)
    assert match, f"{library}{requirement}: want >=LOW,<HIGH"
    return _version(match.group(1)), _version(match.group(2))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("."))


@pytest.mark.parametrize("library", sorted(CHECKED))
def test_pyproject_allows_the_versions_checked_and_no_later_minor(library: str) -> None:
    low, high = _bounds((ROOT / "pyproject.toml").read_text(), library)
    checked = sorted(_version(v) for v in CHECKED[library])
    assert all(low <= v < high for v in checked), (library, low, high, checked)
    newest = checked[-1]
    assert high == (newest[0], newest[1] + 1), (
        f"{library}'s upper bound {high} is not the minor after the newest checked {newest}"
    )


@pytest.mark.parametrize("library", sorted(CHECKED))
def test_the_suite_runs_on_a_version_compat_was_checked_on(library: str) -> None:
    try:
        version = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{library} is not installed")
    minor = ".".join(version.split(".")[:2])
    assert minor in CHECKED[library], (
        f"{library} {version} is not in tapesac_lightning._compat.CHECKED[{library!r}] "
        f"{CHECKED[library]}: run the integration's tests on it, then add it there and move the "
        "bound in pyproject.toml"
    )
