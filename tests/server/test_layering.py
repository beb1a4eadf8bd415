"""Who may import whom (docs/architecture.md "Who may import whom"), read from the source with
``ast``.

Import cycles and upward imports creep in one convenient line at a time and keep working (Python
resolves most cycles lazily), so nothing else would notice. These tests read every ``import``
statement, at module level and inside functions alike (a lazy import is still a dependency), and
check the layers:

- the job store (``server/store/``) sits below the stage pipeline: nothing it imports, directly
  or through other server modules, is ``server.pipeline``, the scheduler or a servicer;
- ``runtime`` imports neither ``server`` nor ``client``;
- the ``client`` library imports only ``rollout.v1`` and itself, and the ``server`` only
  ``runtime``, ``rollout.v1`` and itself: neither reaches the other, nor a composition root;
- ``trainer_adapters`` import only the client (and the generated ``rollout.v1``);
- the composition roots (``entrypoints``: the ``rollout`` command, the quickstart;
  ``benchmarks``) are the only modules that import both sides, and no library imports them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"rollout.client": "client", "rollout.server": "server", "rollout.runtime": "runtime",
           "rollout.trainer_adapters": "trainer_adapters", "rollout.v1": "proto/rollout/v1",
           "rollout.entrypoints": "entrypoints", "rollout.benchmarks": "benchmarks"}
ABOVE_THE_STORE = ("rollout.server.pipeline", "rollout.server.scheduler",
                   "rollout.server.api.servicer", "rollout.server.api.backends_servicer",
                   "rollout.server.app")
COMPOSITION_ROOTS = ("rollout.entrypoints", "rollout.benchmarks")


def _modules() -> dict[str, Path]:
    out = {}
    for name, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


MODULES = _modules()


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement of ``source``.

    ``from a import b`` yields ``a.b`` when that is a module of ours (a submodule import),
    else ``a``; relative imports are resolved against ``module``.
    """
    tree = ast.parse(source)
    top = set(map(id, tree.body))
    # Statements under a module-level if/try (e.g. TYPE_CHECKING) still run at import time.
    for node in tree.body:
        if isinstance(node, ast.If | ast.Try):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in MODULES else base, id(node) in top))
    return out


def _imports_of(module: str) -> list[tuple[str, bool]]:
    path = MODULES[module]
    return imports(path.read_text(), module, path.name == "__init__.py")


def _ours(name: str) -> str | None:
    """The module of ours ``name`` is (or lies in), None for a third-party one."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _closure(roots: list[str]) -> dict[str, str]:
    """Every module of ours reached from ``roots`` through module-level imports, with the
    module that first imported it (to name the culprit in a failure)."""
    seen = {r: r for r in roots}
    todo = list(roots)
    while todo:
        mod = todo.pop()
        for name, at_top in _imports_of(mod):
            target = _ours(name)
            # A package's __init__ runs before any of its modules: it is imported too.
            chain = [target] if target else []
            while target and "." in target:
                target = target.rpartition(".")[0]
                if target in MODULES:
                    chain.append(target)
            for t in chain:
                if at_top and t not in seen:
                    seen[t] = mod
                    todo.append(t)
    return seen


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_walker_sees_each_kind_of_import() -> None:
    """The checks below are only as good as this parser: it must see lazy, relative and
    ``from`` imports, or a violation written that way would pass."""
    src = ("import rollout.server.scheduler\n"
           "from rollout.server import scheduler\n"
           "from ..pipeline import runner\n"
           "from . import job_store\n"
           "def later():\n    from rollout.client import aio\n")
    got = imports(src, "rollout.server.store.job_store")
    assert got == [("rollout.server.scheduler", True), ("rollout.server.scheduler", True),
                   ("rollout.server.pipeline.runner", True),
                   ("rollout.server.store.job_store", True),
                   ("rollout.client.aio", False)]
    assert len([m for m in MODULES if m.startswith("rollout.server.store.")]) >= 3


def test_the_store_imports_nothing_above_it() -> None:
    roots = [m for m in MODULES if _under(m, "rollout.server.store")]
    reached = _closure(roots)
    bad = {m: via for m, via in reached.items() if _under(m, *ABOVE_THE_STORE)}
    assert not bad, f"the store reaches the layers above it (module: imported by): {bad}"
    # And not lazily either: a function-level import is still a cycle at run time.
    lazy = [(m, n) for m in roots for n, _ in _imports_of(m) if _under(n, *ABOVE_THE_STORE)]
    assert not lazy


def test_the_pipeline_uses_the_store_only_through_its_package() -> None:
    """Callers import ``rollout.server.store`` (its ``__init__`` re-exports the API); the
    SQLite writer and the file checks are the store's own business."""
    bad = [(m, n) for m in MODULES if not _under(m, "rollout.server.store")
           for n, _ in _imports_of(m) if _under(n, "rollout.server.store.sqlite")]
    assert not bad


def test_runtime_imports_neither_server_nor_client() -> None:
    bad = _reaches_beyond("rollout.runtime", ("rollout.v1", "rollout.runtime"))
    assert not bad, bad


def _reaches_beyond(package: str, allowed: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(module, imported)`` for every import of ours by ``package`` outside ``allowed``."""
    return [(m, n) for m in MODULES if _under(m, package)
            for n, _ in _imports_of(m) if _under(n, "rollout") and not _under(n, *allowed)]


def test_the_client_library_imports_only_the_contract_and_itself() -> None:
    bad = _reaches_beyond("rollout.client", ("rollout.v1", "rollout.client"))
    assert not bad, f"client modules importing beyond rollout.v1 / rollout.client: {bad}"


def test_the_server_imports_neither_the_client_nor_a_composition_root() -> None:
    bad = _reaches_beyond("rollout.server", ("rollout.v1", "rollout.server", "rollout.runtime"))
    assert not bad, f"server modules importing beyond rollout.v1 / runtime / server: {bad}"


def test_no_library_imports_a_composition_root() -> None:
    bad = [(m, n) for m in MODULES if not _under(m, *COMPOSITION_ROOTS)
           for n, _ in _imports_of(m) if _under(n, *COMPOSITION_ROOTS)]
    assert not bad, bad


def test_the_layering_checks_see_a_violation_in_each_direction() -> None:
    """Each direction's check is only as good as the walker's view of these very files."""
    assert any(_under(n, "rollout.server") for n, _ in _imports_of("rollout.entrypoints.cli"))
    assert any(_under(n, "rollout.client")
               for n, _ in _imports_of("rollout.entrypoints.quickstart"))
    client_side = imports("from rollout.server.app import serve\n", "rollout.client.aio")
    server_side = imports("def f():\n    from rollout.client.aio import RolloutClient\n",
                          "rollout.server.app")
    assert _under(client_side[0][0], "rollout.server")
    assert _under(server_side[0][0], "rollout.client")


def test_trainer_adapters_import_only_the_client() -> None:
    bad = _reaches_beyond("rollout.trainer_adapters",
                          ("rollout.v1", "rollout.client", "rollout.trainer_adapters"))
    assert not bad, bad


IN_SANDBOX = "rollout.runtime.envs.in_sandbox"


def test_nothing_imports_a_script_that_runs_inside_a_sandbox() -> None:
    """``runtime/envs/in_sandbox/`` holds standard-library scripts that handlers read as text
    and write into a sandbox: imported into the server they would run with its privileges, and
    a third-party import added there would break inside the sandbox's bare interpreter."""
    scripts = [m for m in MODULES if _under(m, IN_SANDBOX)]
    assert {"swe_grade_tree", "pytest_report_plugin", "harness_launch", "code_runner"} <= {
        m.rpartition(".")[2] for m in scripts}
    bad = [(m, n) for m in MODULES for n, _ in _imports_of(m) if _under(n, IN_SANDBOX)]
    assert not bad, f"modules importing an in-sandbox script: {bad}"
    assert not (ROOT / "runtime/envs/in_sandbox/__init__.py").exists()
    bad = [(m, n) for m in scripts for n, _ in _imports_of(m) if _under(n, "rollout")]
    assert not bad, f"in-sandbox scripts importing the package: {bad}"


def test_only_server_api_touches_the_generated_grpc_stubs() -> None:
    """The servicer bases and ``add_*_to_server`` live in ``*_pb2_grpc``: the API edge
    (``server/api``) is the one room of the server that speaks them."""
    bad = [(m, n) for m in MODULES if _under(m, "rollout.server")
           and not _under(m, "rollout.server.api")
           for n, _ in _imports_of(m) if _under(n, "rollout.v1") and n.endswith("_pb2_grpc")]
    assert not bad, f"server modules outside server/api importing gRPC stubs: {bad}"
    seen = [n for n, _ in _imports_of("rollout.server.api.services")]
    assert "rollout.v1.rollout_service_pb2_grpc" in seen


def test_the_walker_sees_an_in_sandbox_import() -> None:
    got = imports("from rollout.runtime.envs.in_sandbox import harness_launch\n",
                  "rollout.runtime.envs.harness.handler")
    assert _under(got[0][0], IN_SANDBOX)


def test_the_rootless_build_helper_is_a_standard_library_script() -> None:
    """``runtime/sandbox/images/netns_listen.py`` runs by path with ``python -I -S`` (no
    site-packages) inside a build's namespaces, then becomes buildah: a third-party or package
    import would break it, and nothing may import it into the server."""
    helper = "rollout.runtime.sandbox.images.netns_listen"
    assert helper in MODULES
    bad = [n for n, _ in _imports_of(helper) if n.partition(".")[0] not in sys.stdlib_module_names]
    assert not bad, f"the build helper imports beyond the standard library: {bad}"
    bad = [m for m in MODULES for n, _ in _imports_of(m) if _under(n, helper)]
    assert not bad, f"modules importing the build helper: {bad}"
