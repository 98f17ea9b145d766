"""Recipes: the shipped YAML configs, found by name from any directory.

A recipe is a YAML diff over the config's defaults (engine/config.py), shipped as package data in
`rlflow/conf/` (the repo's `conf/`), or a file of the user's own. Two top-level keys are not config:

    base: demo   # another recipe (a name or a path) whose settings come first
    job: sft     # the job it is for: rl (the default), sft or dpo

Its first comment line says what it is; `rlflow recipes` lists them by it.

Invariants:
- a recipe's settings are its bases' (innermost first), then its own; a base names no circle;
- a name is a recipe only where no file of that name exists: `./gsm8k.yaml` or a path always wins.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

META = ("base", "job")  # a recipe's keys that are not config keys


class RecipeError(ValueError):
    """A recipe that cannot be found or read; the config error names it."""


def shipped() -> dict[str, Path]:
    """{name: path} of every recipe the package ships: those for the user's model first, then the
    embedded demo's (`demo`, `smoke`, `demo-*`), each group by name."""
    root = Path(str(files("rlflow") / "conf"))
    demo = ("demo", "smoke")
    return {p.stem: p for p in sorted(root.glob("*.yaml"), key=lambda p: (p.stem.startswith(demo), p.stem))}


def find(ref: str | Path) -> Path:
    """The file a recipe reference names: an existing file, else a shipped recipe's name."""
    path = Path(ref)
    if path.is_file():
        return path
    recipes = shipped()
    if str(ref) in recipes:
        return recipes[str(ref)]
    if path.suffix in (".yaml", ".yml") or "/" in str(ref):
        raise RecipeError(f"{ref}: no such file")
    raise RecipeError(f"no recipe or file named '{ref}'; the recipes: {', '.join(recipes)} (`rlflow recipes`)")


def parse_yaml(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{what} is not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None


def read(ref: str | Path, _seen: tuple[Path, ...] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    """(the recipe's job or None, its YAML mappings from the innermost base to itself)."""
    path = find(ref).resolve()
    if path in _seen:
        raise RecipeError(f"recipe bases form a circle: {' -> '.join(p.stem for p in (*_seen, path))}")
    diff = parse_yaml(path.read_text(), str(ref)) or {}
    if not isinstance(diff, dict):
        raise RecipeError(f"{ref}: expected a mapping at the top level")
    base, job = diff.pop("base", None), diff.pop("job", None)
    job_of_base, layers = read(str(base), (*_seen, path)) if base else (None, [])
    if job is not None and job_of_base is not None and job != job_of_base:
        raise RecipeError(f"{ref}: job {job} contradicts its base {base}'s job {job_of_base}")
    return job or job_of_base, [*layers, diff]


def describe(path: Path) -> str:
    """A recipe's first comment line: what it is."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def listing() -> str:
    """`rlflow recipes`: one line each, name, job and what it is."""
    rows = [(name, read(name)[0] or "rl", describe(path)) for name, path in shipped().items()]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{name:<{width}}  {job:<3}  {text}" for name, job, text in rows]
    return "\n".join(lines + ["", "run one: rlflow train NAME [key=value ...]; see it resolved: rlflow config NAME"])
