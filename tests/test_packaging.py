"""The wheel carries everything `voxgate serve` needs: every module of engine/ and realtime/, and the browser demo
(installed from a wheel, `GET /` must still answer)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_has_every_module_and_the_demo(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("voxgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT).as_posix() for package in ("engine", "realtime")
               for path in (ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}
    demo = {"realtime/web/" + path.relative_to(ROOT / "web").as_posix()
            for path in (ROOT / "web").rglob("*") if path.is_file()}
    assert "realtime/web/index.html" in demo
    assert modules - names == set() and demo - names == set()
