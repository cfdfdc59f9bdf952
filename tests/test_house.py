"""The house's rules, read off the code's own imports (ast, nothing imported or run).

- `app/` is one folder per concern, in layers: a module imports only its own folder and the
  folders below it (`LAYERS`, lowest first), so data flows one way and nothing imports up;
- `app/errors.py`, the tree of every error, is the bottom: it imports nothing of `app`, so
  every room can raise and answer;
- `app/http` stands alone on it: it imports nothing else of `app`, so the proxy and the
  simulator both build on it;
- the decision (`app/routing`) imports nothing of HTTP or gRPC, and the two doors that ask
  it (`app/proxy`, `app/epp`) nothing of each other;
- no two modules import each other, however indirectly;
- only start-up (`app/cli`) imports the whole `Settings`: every other room is handed a frozen
  slice of what it reads, declared by that room;
- no file of `app/` or `load/` is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app"
# Lowest first. Top-level modules (config.py, models.py) are rooms of their own.
LAYERS = (
    "errors",
    "http",
    "models",
    "discovery_targets",
    "config",
    "observe",
    "budgets",
    "fleet",
    "routing",
    "kv_events",
    "preprocess",
    "proxy",
    "epp",
    "sim",
    "dashboard",
    "cli",
    "__main__",
)
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The `app.*` modules a file imports, each as the deepest module name written."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("app."))
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in APP.rglob("*.py")}
    return {
        name: {target for target in imports_of(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "app"


def test_every_import_points_down_the_layers() -> None:
    upward = []
    for module, targets in graph().items():
        if module == "app":
            continue
        for target in targets:
            if target == "app":
                continue
            here, there = LAYERS.index(room(module)), LAYERS.index(room(target))
            if there > here:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_http_stands_alone_and_the_simulator_does_not_lean_on_the_proxy() -> None:
    edges = graph()
    for module, targets in edges.items():
        if room(module) == "errors":
            assert targets == set(), module
        if room(module) == "http":
            assert {room(target) for target in targets} <= {"http", "errors"}, module
        if room(module) == "sim":
            assert "proxy" not in {room(target) for target in targets}, module


def test_the_decision_knows_no_protocol_and_the_doors_not_each_other() -> None:
    for module, targets in graph().items():
        rooms = {room(target) for target in targets}
        if room(module) == "routing":
            assert not rooms & {"http", "epp", "proxy"}, module
        if room(module) in ("proxy", "epp"):
            assert not rooms & ({"proxy", "epp"} - {room(module)}), module


def test_no_module_imports_itself_through_others() -> None:
    edges = graph()
    seen: set[str] = set()

    def circle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in seen:
            return None
        seen.add(module)
        for target in sorted(edges.get(module, ())):
            found = circle_from(target, [*path, module])
            if found:
                return found
        return None

    for module in sorted(edges):
        assert circle_from(module, []) is None


def test_only_start_up_imports_the_whole_settings() -> None:
    readers = [
        module_name(path)
        for path in sorted(APP.rglob("*.py"))
        if "app.config.Settings" in imports_of(path)
        and room(module_name(path)) not in ("cli", "__main__")
    ]
    assert readers == []


def test_no_file_is_over_500_lines() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {count}"
        for folder in ("app", "load")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert long == []
