"""The package's imports, read from its source (ast): no circle anywhere (a function-level import counts: it is
still a circle of purposes), and none running up the layers of ARCHITECTURE (docs: architecture.md): samplers
know nothing of nodes, the command line or the commands; model_loaders nothing of samplers either; the runtime
nothing of the commands, the demo recipes or the test harness. Inside model_loaders, a family package uses only
what families share (model_loaders/shared) and its kin (a DD student its teacher's blocks)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "fastar"
NOT_PACKAGE = {"tests", ".venv", ".comfyui", "demo", "web", "workflows", "docs", ".ci"}
RUNTIME = ("nodes", "samplers", "model_loaders", "pipeline", "memory", "settings", "speed_dial", "errors", "interrupts",
           "torch_version")
ABOVE_RUNTIME = ("commands", "demo_recipes", "tools")  # the commands, the demo recipes, the ComfyUI test harness
BELOW = {  # a layer -> what it must never import
    "samplers": ("nodes", "cli", "pipeline", "settings", "speed_dial", *ABOVE_RUNTIME),
    "model_loaders": ("samplers", "nodes", "cli", "pipeline", "settings", "speed_dial", *ABOVE_RUNTIME),
    "commands": ("demo_recipes", "tools"),  # the recipes may use the commands' training helpers, not the reverse
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & NOT_PACKAGE}


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """The package modules ``name`` imports (relative or absolute, at any depth of its code)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                target = ".".join([*filter(None, base), *([node.module] if node.module else [])])
            elif (node.module or "").startswith(PACKAGE + "."):
                target = node.module[len(PACKAGE) + 1:]
            else:
                continue
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name[len(PACKAGE) + 1:] for a in node.names if a.name.startswith(PACKAGE + ".")}
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


FAMILIES = ("llamagen", "chameleon", "janus", "mar", "var", "dd")  # model_loaders' family packages
KIN = {"dd": ("llamagen",), "var": ("dd",)}  # DD students build on LlamaGen's blocks; VAR-DD on DD's head


def family_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "model_loaders" and parts[1] in (*FAMILIES, "shared") else None


def cross_family_imports(graph: dict[str, set[str]]) -> list[str]:
    """A family uses only what families share (model_loaders.shared) and its own kin; shared uses no family."""
    wrong = []
    for name, targets in graph.items():
        family = family_of(name)
        if family is None:
            continue
        allowed = ("shared", family) if family != "shared" else ("shared",)
        allowed += KIN.get(family, ())
        wrong += [f"{name} -> {t}" for t in targets
                  if within(t, ("model_loaders",)) and t != "model_loaders"
                  and not within(t, tuple(f"model_loaders.{a}" for a in allowed))]
    return wrong


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for name, targets in graph.items():
        for layer, forbidden in BELOW.items():
            if within(name, (layer,)):
                wrong += [f"{name} -> {t}" for t in targets if within(t, forbidden)]
        if within(name, RUNTIME):
            wrong += [f"{name} -> {t}" for t in targets if within(t, ABOVE_RUNTIME)]
    return wrong


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 90 and {"settings", "commands.generate"} <= graph["cli"], graph["cli"]
    assert circles(graph) == []


def test_no_import_runs_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_families_share_only_through_model_loaders_shared():
    assert cross_family_imports(import_graph()) == []


MOST_MODULES_PER_FOLDER = 15  # past that a folder stops showing the design: group its modules by purpose


def crowded_folders(root: Path = ROOT) -> dict[str, int]:
    """The package's folders holding more than MOST_MODULES_PER_FOLDER modules (``__init__`` not counted)."""
    counts: dict[str, int] = {}
    for path in package_modules(root).values():
        if path.name != "__init__.py":
            folder = path.parent.relative_to(root).as_posix()
            counts[folder] = counts.get(folder, 0) + 1
    return {folder: n for folder, n in counts.items() if n > MOST_MODULES_PER_FOLDER}


def test_no_folder_of_the_package_is_crowded():
    assert crowded_folders() == {}


def test_the_folder_check_sees_a_crowded_folder(tmp_path):
    for i in range(MOST_MODULES_PER_FOLDER + 1):
        (tmp_path / "samplers").mkdir(exist_ok=True)
        (tmp_path / "samplers" / f"loop_{i}.py").write_text("")
    assert crowded_folders(tmp_path) == {"samplers": MOST_MODULES_PER_FOLDER + 1}


def test_the_checks_see_a_circle_and_an_upward_import_added_on_purpose(tmp_path):
    """A copy of the package with ``samplers.token_loops.jacobi`` importing the CLI, which imports the samplers."""
    for path in package_modules().values():
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    jacobi = tmp_path / "samplers" / "token_loops" / "jacobi.py"
    jacobi.write_text(jacobi.read_text() + "\n\ndef _loop():\n    from ...cli import main  # noqa\n")
    graph = import_graph(tmp_path)
    assert any("samplers.token_loops.jacobi" in group and "cli" in group for group in circles(graph))
    assert "samplers.token_loops.jacobi -> cli" in upward_imports(graph)


def test_the_family_check_sees_a_family_borrowing_from_another():
    graph = import_graph()
    assert cross_family_imports(graph) == []
    graph["model_loaders.janus.model"] = graph["model_loaders.janus.model"] | {"model_loaders.chameleon.model"}
    graph["model_loaders.shared.protocol"] = graph["model_loaders.shared.protocol"] | {"model_loaders.mar.model"}
    assert set(cross_family_imports(graph)) == {"model_loaders.janus.model -> model_loaders.chameleon.model",
                                                "model_loaders.shared.protocol -> model_loaders.mar.model"}


def test_pyproject_installs_every_package_folder():
    """A folder missing from pyproject.toml's list installs without its modules (pip install . would break)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("fastar", *path.parent.relative_to(ROOT).parts))
               for path in package_modules(ROOT).values() if path.name == "__init__.py"}
    assert folders == listed, (folders - listed, listed - folders)
