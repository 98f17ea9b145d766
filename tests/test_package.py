"""A wheel of the project holds every package the code imports, not only those an editable install finds."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_wheel_holds_every_package(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", ".gpuhost", "build", "*.egg-info",
                                                             "tests", "docs", "bench", "__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                          "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    held = {name.rsplit("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist() if name.endswith("/__init__.py")}
    wanted = {str(p.parent.relative_to(ROOT)) for top in ("engine", "stages", "pipelines")
              for p in (ROOT / top).rglob("__init__.py")}
    assert held == wanted
