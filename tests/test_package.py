"""A wheel of the project holds one import package, `rlflow`: every subpackage the code imports (not
only those an editable install finds) and the shipped recipes, which `rlflow train NAME` reads from
any directory."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_wheel_holds_one_package_with_every_subpackage_and_recipe(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout; links stay links
    shutil.copytree(ROOT, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".venv", ".git", ".gpuhost", "build", "*.egg-info", "tests", "docs",
                                                  "bench", "__pycache__", "outputs", "mlflow.db"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                          "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"rlflow"}
    held = {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}
    wanted = {"rlflow"} | {f"rlflow/{p.parent.relative_to(ROOT)}" for top in ("engine", "stages", "pipelines")
                           for p in (ROOT / top).rglob("__init__.py")}
    assert held == wanted
    recipes = {f"rlflow/{p.relative_to(ROOT)}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert recipes and recipes <= set(names)
