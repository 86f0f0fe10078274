"""The package's rooms and its import rules, read from the source with `ast`.

- The library (`tensor_parallel_toy/*.py`) imports neither the harness (`profiling/`), nor the
  post's build code (`post/`), nor the tests; the harness does not import the post or the
  tests; the post may read the harness (its results' formats, the memory formula); the tests
  import all three (they test all three). The
  command line, `__main__.py`, and the runnable examples (`examples/`, which may train on the
  harness's corpus) are front doors that lead to either room and are exempt.
- No module imports another module's underscore name, nor reads one as `module._name`: a test
  of that very module (`tests/test_X.py` of module `X`) aside. A module that needs another's
  private name is a sign the boundary between them is in the wrong place.
- No test file imports from another test file: what tests share lives in `tests/helpers.py`.
- Inside the harness, imports run one way: cli -> flags -> run/ -> wires/ -> report/ ->
  measure/ (any of them may read spec.py), never back up.
"""
import ast
import io
import os
import re
import tokenize

import pytest

PACKAGE = "tensor_parallel_toy"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READING_PATH_MAX_CODE_LINES = 765  # 650 before classic TP, the KV-cache seam and the layouts joined
# the path; 3 more for the collectives' names on torch 2.11 (a GPU image's torch); 17 more for
# any vocabulary size (the padding: Layout.full_size, the head's `pad`, the loss's mask)
# The harness's rooms, one job each: running the modes, measuring, the wires, reporting.
HARNESS_ROOMS = ("run", "measure", "wires", "report")
# Between the harness's parts imports run down this list, never up it; spec.py is for all.
HARNESS_ORDER = ("cli", "flags", "run", "wires", "report", "measure")


def _modules(package_dir):
    """{dotted module name: file path} of every .py file under the package."""
    root = os.path.dirname(package_dir)
    found = {}
    for folder, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("profiling", "post", "tests") else "library"


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module, node, packages):
    """The absolute name an ImportFrom refers to, from inside `module`."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if module not in packages:  # a plain module: its own package is one level up
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _tested_module(module):
    """`tests.test_comm` tests `comm`: the one module whose private names it may read."""
    last = module.split(".")[-1]
    return last[len("test_"):] if _room(module) == "tests" and last.startswith("test_") else None


def layout_problems(package_dir):
    """One line per broken rule, naming the file and the import."""
    modules = _modules(package_dir)
    packages = {m for m, path in modules.items() if path.endswith("__init__.py")}
    problems = []
    for module, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        where = os.path.relpath(path, os.path.dirname(package_dir))
        module_names = {}  # local name -> package module it is bound to

        def check_target(target, what, line):
            if not target.startswith(PACKAGE):
                return
            room, target_room = _room(module), _room(target)
            allowed = {"library", room} | {"tests": {"profiling", "post"},
                                           "post": {"profiling"}}.get(room, set())
            front_door = module == f"{PACKAGE}.__main__" or module.startswith(
                f"{PACKAGE}.examples.")
            if target_room not in allowed and not front_door:
                problems.append(f"{where}:{line}: {what}: the {room} imports the {target_room}")
            if (room == "tests" and target_room == "tests" and target != module
                    and target.split(".")[-1].startswith("test_")):
                problems.append(f"{where}:{line}: {what}: a test file imports another test file")

        def check_private(target, name, what, line):
            if (target.startswith(PACKAGE) and _private(name) and target != module
                    and target.split(".")[-1] != _tested_module(module)):
                problems.append(f"{where}:{line}: {what}: imports the private name {name!r} "
                                f"of {target}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    check_target(alias.name, f"import {alias.name}", node.lineno)
                    if alias.asname and alias.name in modules:
                        module_names[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, packages)
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    what = f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                    if full in modules:  # a module, imported by name
                        check_target(full, what, node.lineno)
                        module_names[alias.asname or alias.name] = full
                    else:
                        check_target(target, what, node.lineno)
                        check_private(target, alias.name, what, node.lineno)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_names):
                check_private(module_names[node.value.id], node.attr,
                              f"{node.value.id}.{node.attr}", node.lineno)
    return problems


def harness_order_problems(package_dir):
    """One line per import from a harness part to one above it in HARNESS_ORDER (measure/
    importing report/, report/ importing run/...), function-level imports included."""
    modules = _modules(package_dir)
    packages = {m for m, path in modules.items() if path.endswith("__init__.py")}

    def part(name):
        parts = name.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == [PACKAGE, "profiling"] else None

    problems = []
    for module, path in sorted(modules.items()):
        if part(module) not in HARNESS_ORDER:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, packages)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if (part(target) in HARNESS_ORDER and HARNESS_ORDER.index(part(target))
                        < HARNESS_ORDER.index(part(module))):
                    problems.append(f"{os.path.relpath(path, os.path.dirname(package_dir))}:"
                                    f"{node.lineno}: {part(module)} imports {target}, above it "
                                    f"in {' -> '.join(HARNESS_ORDER)}")
    return problems


def test_the_harness_rooms_import_one_way():
    problems = harness_order_problems(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text", ["from ..report import plots\n",
                                  "def f():\n    from ..run.train import run_modes\n",
                                  "import tensor_parallel_toy.profiling.cli\n"])
def test_the_harness_order_check_catches_an_import_upwards(tmp_path, text):
    harness = tmp_path / PACKAGE / "profiling"
    for room in HARNESS_ROOMS:
        (harness / room).mkdir(parents=True)
        (harness / room / "__init__.py").write_text("")
    for name in ("__init__.py", "profiling/__init__.py", "profiling/cli.py",
                 "profiling/spec.py", "profiling/report/plots.py", "profiling/run/train.py"):
        (tmp_path / PACKAGE / name).write_text("")
    (harness / "measure" / "metrics.py").write_text("from ..spec import SEQ\n" + text)
    assert len(harness_order_problems(str(tmp_path / PACKAGE))) == 1


def test_the_rooms_exist_and_the_library_readme_names_every_module():
    for room in ("profiling", "post", "tests"):
        assert os.path.isfile(os.path.join(PACKAGE_DIR, room, "__init__.py")), room
    library = sorted(f for f in os.listdir(PACKAGE_DIR) if f.endswith(".py"))
    strays = [f for f in library if f.startswith("test_") or f == "conftest.py"]
    assert not strays, f"tests outside tests/: {strays}"
    # The library's README is where a learner finds what each module holds: a module it does
    # not name is one nobody will find, a name it keeps for a deleted module misleads.
    with open(os.path.join(PACKAGE_DIR, "README.md"), encoding="utf-8") as f:
        first_cells = re.findall(r"^\|([^|]*)\|", f.read(), flags=re.M)
    named = {n for cell in first_cells for n in re.findall(r"`([\w/]+\.py)`", cell)}
    # The harness's modules by their path inside profiling/: cli.py, run/train.py, ...
    harness_dir = os.path.join(PACKAGE_DIR, "profiling")
    for room in HARNESS_ROOMS:
        assert os.path.isfile(os.path.join(harness_dir, room, "__init__.py")), f"profiling/{room}"
    harness = sorted(os.path.relpath(os.path.join(folder, f), harness_dir).replace(os.sep, "/")
                     for folder, _, files in os.walk(harness_dir) for f in files
                     if f.endswith(".py") and f != "__init__.py" and "__pycache__" not in folder)
    modules = {f for f in library if f != "__init__.py"} | set(harness)
    modules |= {f"post/{f}" for f in os.listdir(os.path.join(PACKAGE_DIR, "post"))
                if f.endswith(".py") and f != "__init__.py"}
    modules |= {f"examples/{f}" for f in os.listdir(os.path.join(PACKAGE_DIR, "examples"))
                if f.endswith(".py") and f != "__init__.py"}
    for sub in os.listdir(PACKAGE_DIR):  # the library's own sub-packages (apply/, ...)
        folder = os.path.join(PACKAGE_DIR, sub)
        if sub not in ("profiling", "post", "tests", "examples") and \
                os.path.isfile(os.path.join(folder, "__init__.py")):
            modules |= {f"{sub}/{f}" for f in os.listdir(folder)
                        if f.endswith(".py") and f != "__init__.py"}
    assert modules <= named, f"not in tensor_parallel_toy/README.md: {sorted(modules - named)}"
    stale = {n for n in named if not n.startswith(("test_", "conftest", "helpers"))} - modules
    assert not stale, f"tensor_parallel_toy/README.md names modules that do not exist: {stale}"


def reading_path(package_dir=PACKAGE_DIR):
    """The files the library README's `Reading path:` line names, in its order."""
    with open(os.path.join(package_dir, "README.md"), encoding="utf-8") as f:
        lines = [line for line in f if line.startswith("Reading path:")]
    assert len(lines) == 1, f"{len(lines)} lines begin with 'Reading path:' in the library README"
    return re.findall(r"`([\w/]+\.py)`", lines[0])


def code_lines(path):
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                              tokenize.DEDENT, tokenize.ENDMARKER):
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


# What the kernel (the reading path) may import of the package: one another, and these.
KERNEL_MAY_IMPORT = ("config", "rotary")


def kernel_problems(package_dir):
    """One line per import of the reading path outside the kernel, and per check it calls."""
    modules = _modules(package_dir)
    packages = {m for m, p in modules.items() if p.endswith("__init__.py")}
    kernel = {f"{PACKAGE}.{name[:-3].replace('/', '.')}" for name in reading_path(package_dir)}
    allowed = kernel | {f"{PACKAGE}.{name}" for name in KERNEL_MAY_IMPORT}
    problems = []
    for module in sorted(kernel):
        with open(modules[module], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        targets = [(node.lineno, _resolve(module, node, packages)) for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom)]
        targets += [(node.lineno, alias.name) for node in ast.walk(tree)
                    if isinstance(node, ast.Import) for alias in node.names]
        problems += [f"{module} imports {t} (line {line}): the kernel imports only itself, "
                     f"{', '.join(KERNEL_MAY_IMPORT)}" for line, t in targets
                     if t.startswith(PACKAGE) and t not in allowed]
        called = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                  for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and isinstance(node.func, (ast.Name, ast.Attribute))}
        # check_divisible, check_tp_size: size preconditions of the split itself (Megatron's
        # ensure_divisibility), not guards.
        problems += [f"{module} calls {c}" for c in sorted(called)
                     if c.startswith(("check_", "agree_"))
                     and c not in ("check_divisible", "check_tp_size")]
    return problems


def test_the_reading_path_is_a_short_kernel_that_enters_no_guard():
    """A learner follows the idea from the region functions to the Transformer without entering
    a check, and only then the ring that overlaps it: the reading path holds at most 745 lines of code and imports nothing of the
    package but its own files, config.py and rotary.py (guards, plans, interop, the launcher
    and the harness are its clients: arrows run only into it), and calls no check but the
    split's own size preconditions."""
    path = reading_path()
    # The idea before the optimization: a working TP + SP model first, the ring last.
    assert path[0] == "comm.py" and path[-2:] == ["model.py", "ring.py"] and \
        "parallel_linear.py" in path, path
    counts = {f: code_lines(os.path.join(PACKAGE_DIR, f)) for f in path}
    assert sum(counts.values()) <= READING_PATH_MAX_CODE_LINES, counts
    problems = kernel_problems(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_the_kernel_rule_catches_an_import_of_a_client_and_a_check(tmp_path):
    """The rule above must be able to fail: a kernel file importing guards/ is caught, and so
    is a check called on the path."""
    import shutil

    copy = tmp_path / PACKAGE
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    model = copy / "model.py"
    model.write_text(model.read_text().replace(
        "import math\n", "import math\nfrom .guards.batch import check_batch\n", 1).replace(
        "        s = input_ids.shape[1]\n", "        s = input_ids.shape[1]\n"
        "        check_batch(self, input_ids)\n", 1))
    problems = kernel_problems(str(copy))
    assert any("imports tensor_parallel_toy.guards.batch" in p for p in problems), problems
    assert any("calls check_batch" in p for p in problems), problems


def test_imports_run_into_the_library_and_no_private_name_crosses_a_module():
    problems = layout_problems(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


# The checker itself must be able to fail.
_BAD_TREES = {
    "library imports the harness": {"comm.py": "from .profiling import cli\n"},
    "harness imports the tests": {"profiling/cli.py": "from ..tests import helpers\n"},
    "test imports a test": {"tests/test_a.py": "from .test_b import CONFIG\n",
                            "tests/test_b.py": "CONFIG = 1\n"},
    "private name": {"model.py": "from .parallel_linear import _Fn\n"},
    "private attribute": {"profiling/cli.py": "from .. import comm\nx = comm._recorder\n"},
}


@pytest.mark.parametrize("files", list(_BAD_TREES.values()), ids=list(_BAD_TREES))
def test_layout_checker_catches_each_broken_rule(tmp_path, files):
    package = tmp_path / PACKAGE
    for folder in (package, package / "profiling", package / "tests"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    for name in ("comm.py", "parallel_linear.py", "model.py", "profiling/cli.py"):
        (package / name).write_text("")
    for name, text in files.items():
        (package / name).write_text(text)
    problems = layout_problems(str(package))
    assert len(problems) == 1, problems


def test_layout_checker_allows_a_test_to_read_its_own_module(tmp_path):
    package = tmp_path / PACKAGE
    (package / "tests").mkdir(parents=True)
    for name in ("__init__.py", "tests/__init__.py", "comm.py"):
        (package / name).write_text("")
    (package / "tests" / "test_comm.py").write_text(
        "from tensor_parallel_toy import comm\nfrom tensor_parallel_toy.comm import _x\n"
        "y = comm._recorder\n")
    assert layout_problems(str(package)) == []


# ----------------------------------------------------------------------------------------------
# One forward for every use
# ----------------------------------------------------------------------------------------------
# The operations the forward is made of, each written once, in the kernel: a client (the plan's
# layers, classic TP, generation, the halves) calls the kernel's layer or its piece instead.
ONE_CALL_SITE = {"scaled_dot_product_attention": "model.py", "embedding": "vocab_parallel.py"}
# What only the kernel's layers may call: a client calling them writes its own layer.
KERNEL_ONLY = ("linear", "reduce_from_tensor_parallel_region", "copy_to_row_holders")


def forward_copies(package_dir):
    """One line per call that makes a second copy of a piece of the forward outside the
    kernel: attention or an embedding lookup called anywhere but their one site, a GEMM or a
    layer's sum (`F.linear`, `g`) called by a library client (the harness, the post, the
    examples and the tests measure and check, and may)."""
    kernel = set(reading_path(package_dir))
    found, problems = {name: [] for name in ONE_CALL_SITE}, []
    for module, path in sorted(_modules(package_dir).items()):
        rel = os.path.relpath(path, package_dir)
        if _room(module) != "library" or rel.startswith("examples" + os.sep):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute))):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in found:
                found[name].append(f"{rel}:{node.lineno}")
            if name in KERNEL_ONLY and rel not in kernel:
                problems.append(f"{rel}:{node.lineno} calls {name}: a layer of its own; call "
                                f"the kernel's layer or its piece (gemm, lookup, attend)")
    for name, sites in found.items():
        if sites != [s for s in sites if s.startswith(ONE_CALL_SITE[name] + ":")] or \
                len(sites) != 1:
            problems.append(f"{name} called at {sites}: once, in {ONE_CALL_SITE[name]}")
    return problems


def test_attention_the_embedding_lookup_and_the_layers_are_written_once():
    """Generation, the halves, the plan's layers and classic TP run the kernel's forward: one
    call site of scaled-dot-product attention and of the embedding lookup in the library, and
    no GEMM or sum of a layer of their own."""
    problems = forward_copies(PACKAGE_DIR)
    assert not problems, "\n".join(problems)


def test_the_one_forward_rule_catches_a_private_attention_and_a_private_row_layer(tmp_path):
    import shutil

    copy = tmp_path / PACKAGE
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    generate = copy / "inference" / "generate.py"
    generate.write_text(generate.read_text() + (
        "\n\ndef _attention(q, k, v):\n"
        "    return torch.nn.functional.scaled_dot_product_attention(q, k, v)\n"
        "\n\ndef _row(layer, x, group):\n"
        "    return reduce_from_tensor_parallel_region(F.linear(x, layer.weight), group)\n"))
    problems = forward_copies(str(copy))
    assert any("scaled_dot_product_attention called at" in p for p in problems), problems
    assert sum("inference/generate.py" in p and "a layer of its own" in p
               for p in problems) == 2, problems


def kernel_import_circles(package_dir):
    """The circles among the kernel's files' imports (at any depth: a function-level import
    counts), each as a list of files, e.g. ["parallel_linear.py", "ring.py"]."""
    modules = _modules(package_dir)
    packages = {m for m, p in modules.items() if p.endswith("__init__.py")}
    kernel = {f"{PACKAGE}.{name[:-3]}": name for name in reading_path(package_dir)}
    edges = {}
    for module, name in kernel.items():
        with open(modules[module], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        edges[name] = {kernel[t] for t in (_resolve(module, node, packages)
                                           for node in ast.walk(tree)
                                           if isinstance(node, ast.ImportFrom)) if t in kernel}
    circles = []

    def visit(name, path):
        for target in sorted(edges[name]):
            if target in path:
                circle = path[path.index(target):]
                if min(circle) == circle[0] and circle not in circles:  # each once
                    circles.append(circle)
            else:
                visit(target, path + [target])
    for name in sorted(edges):
        visit(name, [name])
    return circles


def test_the_kernels_files_import_one_another_without_a_circle():
    """Read in order, each file needs only the ones before it or beside it: ring.py, the
    overlap read last, imports comm.py alone, and the layers import the ring."""
    circles = kernel_import_circles(PACKAGE_DIR)
    assert not circles, circles
