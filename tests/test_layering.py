"""Imports only point down: pipelines -> stages -> engine, no project modules import each other in a
circle, and everything imports the project as `rlflow.*`: a bare `engine`, `stages` or `pipelines` would
load a second copy from the repo root, or a user's own folder of that name."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"engine": {"stages", "pipelines"}, "stages": {"pipelines"}}
PROJECT = ("engine", "stages", "pipelines")


def _package(module: str) -> str:
    """The top-level package of a module, or the layer for rlflow's own (`rlflow.engine.x` -> engine)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "rlflow" and len(parts) > 1 else parts[0]


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {_package(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_package(node.module))
    return names


def test_the_project_is_imported_as_rlflow_only():
    bare = {str(p.relative_to(ROOT)): sorted({f"{n.module}" for n in ast.walk(ast.parse(p.read_text()))
                                             if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
                                             and n.module.split(".")[0] in PROJECT}
                                            | {a.name for n in ast.walk(ast.parse(p.read_text()))
                                               if isinstance(n, ast.Import) for a in n.names
                                               if a.name.split(".")[0] in PROJECT})
            for top in (*PROJECT, "tests", "bench", "docs") for p in (ROOT / top).rglob("*.py")}
    assert {k: v for k, v in bare.items() if v} == {}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    bad = {str(p.relative_to(ROOT)): imported_packages(p) & FORBIDDEN[layer] for p in (ROOT / layer).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}


def test_algorithms_are_known_by_name_in_their_registry_alone():
    """Only engine/algos.py compares an algorithm's name (an estimator, a policy loss, a loss
    aggregation, a KL estimator, a rollout correction): everything else asks the registry what an
    algorithm needs, so a new one is one entry there, not a hunt through the config, the stages
    and the pipelines for the places that must learn it."""
    from rlflow.engine import algos

    names = {*algos.ESTIMATORS, *algos.POLICY_LOSSES, *algos.LOSS_AGGS, *algos.KL_ESTIMATORS,
             *algos.ROLLOUT_CORRECTIONS} - {algos.NO_CORRECTION}
    found = []
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "engine" / "algos.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                if isinstance(node, ast.Compare) and named:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_algorithm_math_is_import_light():
    assert imported_packages(ROOT / "engine" / "algos.py") <= {"torch", "dataclasses", "__future__", "typing", "math",
                                                             "collections"}


def project_modules() -> dict[str, Path]:
    """Every module under PROJECT by dotted name; a package's `__init__` is named by the package."""
    mods = {}
    for top in PROJECT:
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            mods[".".join(("rlflow", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = p
    return mods


def import_edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its body, function-local imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []  # a relative import's package
            module = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:  # `from pkg import mod` names the module, else the name lives in `module`
                target = f"{module}.{a.name}"
                out.add(target if target in mods else module)
    return out & set(mods)


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each circle a depth-first walk of `graph` meets, as "a -> b -> a"."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] - {node}):
            if state[nxt] == 1:
                found.append(" -> ".join(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]))
            elif state[nxt] == 0:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node, [])
    return found


def test_no_import_circle():
    mods = project_modules()
    found = circles({name: import_edges(name, path, mods) for name, path in mods.items()})
    assert not found, "import circles:\n" + "\n".join(found)


def part(module: str) -> str:
    """The part of the project a module belongs to: one of engine's folders (rollout, train, data,
    agents), or a module of engine's own (config, tensors, vmm, ...), or stages, or pipelines."""
    parts = module.split(".")[1:]  # rlflow.engine.rollout.model -> engine, rollout, model
    if parts[0] != "engine" or len(parts) < 2:
        return parts[0]
    return "/".join(parts[:2]) if (ROOT / parts[0] / parts[1]).is_dir() else ".".join(parts[:2])


def test_no_circle_between_engines_folders_and_shared_modules():
    """Folder by folder the imports still point one way: no engine folder imports another that
    imports it back, directly or through a shared module (tensors, config, ...), function-local
    imports included."""
    mods = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph.setdefault(part(name), set()).update(part(t) for t in import_edges(name, path, mods))
    found = circles(graph)
    assert not found, "circles between the project's parts:\n" + "\n".join(found)


def test_no_stage_has_more_than_six_verbs_inherited_ones_included():
    """A stage's public methods, its bases' included (a hybrid policy is a policy that also
    generates, and answers for all of it), beside the checkpoint pair every stateful stage has
    (`save`, `load`, which the driver calls on each alike): six at most, so that no stage grows
    back into a god object, on its own or through a base."""
    import importlib
    import inspect

    from torch import nn

    stages = []
    for path in sorted((ROOT / "stages").glob("*.py")):
        if path.stem == "worker":  # the process that hosts stages, not one
            continue
        module = importlib.import_module(f"rlflow.stages.{path.stem}")
        stages += [c for n, c in inspect.getmembers(module, inspect.isclass)
                   if c.__module__ == module.__name__ and not n.startswith("_") and not issubclass(c, nn.Module)]
    assert {c.__name__ for c in stages} >= {"Policy", "HybridPolicy", "PolicySender", "Rollout", "Reward", "Critic",
                                            "Advantage", "Reference"}
    verbs = {c.__name__: sorted(n for n in dir(c) if callable(getattr(c, n)) and not n.startswith("_")
                                and n not in ("save", "load")) for c in stages}
    assert {name: v for name, v in verbs.items() if len(v) > 6} == {}
    assert verbs["HybridPolicy"] == sorted(verbs["Policy"] + ["generate"])


def test_no_stage_or_pipeline_names_a_rollout_backend():
    """Stages and pipelines ask an engine what it can do (`streams`, `swaps`), never its class:
    a backend that declares a capability gets used for it with no edit above the engine."""
    backends = {"NativeRollout", "HFRollout", "VLLMRollout"}
    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for top in ("stages", "pipelines")
             for p in sorted((ROOT / top).rglob("*.py")) for n in ast.walk(ast.parse(p.read_text()))
             if (isinstance(n, ast.Name) and n.id in backends) or (isinstance(n, ast.alias) and n.name in backends)]
    assert not found, found


def test_no_class_runs_over_300_lines():
    """A class a reader holds in mind at once: one that outgrows it splits by idea (the native
    rollout engine is a loop over a scheduler and a model runner)."""
    long = {f"{p.relative_to(ROOT)}:{n.name}": n.end_lineno - n.lineno + 1
            for top in PROJECT for p in (ROOT / top).rglob("*.py") for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.ClassDef) and n.end_lineno and n.end_lineno - n.lineno >= 300}
    assert long == {}


def test_no_two_public_classes_share_a_name():
    """One name, one thing: a reader who meets `Step` or `Policy` knows which one it is."""
    seen: dict[str, list[str]] = {}
    for top in PROJECT:
        for p in (ROOT / top).rglob("*.py"):
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                    seen.setdefault(n.name, []).append(str(p.relative_to(ROOT)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
