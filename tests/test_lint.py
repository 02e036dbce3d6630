"""Static guard for invariant trainer-loop-free: no blocking call inside async code of the library."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_no_blocking_calls_in_async_code():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (dev extra)")
    proc = subprocess.run([ruff, "check", "--select", "ASYNC", "--no-cache", "weightsync", "server", "client",
                           "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


PICKLING_MODULES = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle"}
PICKLING_CALLS = {("torch", "load"), ("torch", "save"), ("numpy", "load"), ("np", "load")}


def pickling_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every import of a pickling module and every call that unpickles or pickles
    (``pickle.*``, ``torch.load``/``torch.save``, ``numpy.load``), found in the syntax
    tree: an alias or a call inside a function counts as much as a top-level import."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append(f"{filename}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "numpy"):
            found += [f"{filename}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                      if (node.module, a.name) in PICKLING_CALLS]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and ((owner.id, node.func.attr) in PICKLING_CALLS
                                                 or owner.id in PICKLING_MODULES):
                found.append(f"{filename}:{node.lineno} {owner.id}.{node.func.attr}(...)")
    return found


def test_the_pickle_check_sees_calls_and_aliases_not_only_imports():
    assert pickling_uses("import pickle as p\n")
    assert pickling_uses("def f(b):\n    import torch\n    return torch.load(b)\n")
    assert pickling_uses("from torch import save\n")
    assert pickling_uses("import cloudpickle\n")
    assert pickling_uses("x = marshal.loads(b)\n")
    assert not pickling_uses("import torch\nt = torch.zeros(3)\nnp.frombuffer(b)\n")


def test_no_pickle_on_any_wire():
    offenders = [use for folder in ("weightsync", "server", "client") for p in sorted((ROOT / folder).rglob("*.py"))
                 for use in pickling_uses(p.read_text(), str(p.relative_to(ROOT)))]
    assert offenders == []


def imports_of(source: str) -> set[str]:
    """Every module a source imports, at any depth (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_import_check_sees_lazy_and_from_imports():
    assert "weightsync.apps.demo" in imports_of("def f():\n    from weightsync.apps import demo\n")
    assert "weightsync.apps.cli" in imports_of("import weightsync.apps.cli as c\n")
    assert not any(n.startswith("weightsync.apps") for n in imports_of("from weightsync import plan\n"))


def test_dependencies_point_one_way():
    """Dependencies point one way: apps (CLI, demo, bench, local cluster) -> server/client
    -> core. ``weightsync/__main__.py`` is the entry point that runs the CLI."""
    core = [p for p in sorted((ROOT / "weightsync").rglob("*.py"))
            if "apps" not in p.relative_to(ROOT).parts and p.name != "__main__.py"]
    offenders = [(str(p.relative_to(ROOT)), name) for p in [*core, *(ROOT / "server").rglob("*.py"),
                                                            *(ROOT / "client").rglob("*.py")]
                 for name in imports_of(p.read_text()) if name.startswith("weightsync.apps")]
    offenders += [(str(p.relative_to(ROOT)), name) for p in sorted((ROOT / "client").rglob("*.py"))
                  for name in imports_of(p.read_text()) if name.startswith("weightsync.server")]
    assert offenders == []


def test_servers_start_without_torchs_distributed_tensor():
    """``torch.distributed.tensor`` takes about half a second to import, in every
    coordinator, agent and trainer process a test or a user starts; only a trainer
    holding DTensors needs it, and it has imported it already (``sharding``)."""
    code = ("import sys, weightsync.server.coordinator.main, weightsync.server.agent.main, weightsync.client; "
            "print('torch.distributed.tensor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


SIDES = {"coordinator": "weightsync.server.agent", "agent": "weightsync.server.coordinator"}


def test_each_server_process_keeps_to_its_side():
    """server/coordinator/ never imports the agent's side, server/agent/ never the
    coordinator's, server/common/ neither; and nothing imports the source folders by
    their own names (``server.``, ``client.``): they are installed as weightsync.*."""
    offenders = []
    for side, forbidden in SIDES.items():
        for p in sorted((ROOT / "server" / side).rglob("*.py")):
            offenders += [(str(p.relative_to(ROOT)), n) for n in imports_of(p.read_text())
                          if n == forbidden or n.startswith(forbidden + ".")]
    for p in sorted((ROOT / "server" / "common").rglob("*.py")):
        offenders += [(str(p.relative_to(ROOT)), n) for n in imports_of(p.read_text())
                      if any(n == f or n.startswith(f + ".") for f in SIDES.values())]
    for folder in ("weightsync", "server", "client", "tests", "benchmarks"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            offenders += [(str(p.relative_to(ROOT)), n) for n in imports_of(p.read_text())
                          if n.split(".")[0] in ("server", "client")]
    assert offenders == []
    assert sorted(p.name for p in (ROOT / "server").glob("*.py")) == ["__init__.py"], "a module outside the sides"


def test_the_plan_and_the_stores_have_no_import_circle():
    """Each pair depended on the other (lazily); both now depend on a module of their own."""
    def imports(rel: str) -> set[str]:
        return imports_of((ROOT / rel).read_text())

    assert not any(n.startswith("weightsync.plan") for n in imports("weightsync/dtypes.py"))
    assert not any(n.startswith("weightsync.transport.store") for n in imports("weightsync/transport/secure_store.py"))


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every ``from weightsync... import _name``: a module reaching into another's
    private names (what a module keeps private may change without notice)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "weightsync":
            found += [f"{filename}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_the_private_import_check_sees_private_names_only():
    assert private_imports("from weightsync.client.trainer import _Lane\n")
    assert private_imports("def f():\n    from weightsync.plan import Plan, _varint\n")
    assert not private_imports("from weightsync.plan import BucketPlan\nfrom weightsync import __version__\n")
    assert not private_imports("from torch.distributed.tensor._utils import _compute_local_shape\n")


def test_no_module_imports_anothers_private_names():
    found = []
    for folder in ("weightsync", "server", "client", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts:
                continue  # generated
            found += private_imports(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], found

