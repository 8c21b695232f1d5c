"""The wheel carries everything `voxgate serve` needs: every module of engine/ and realtime/, and the browser demo.
Installed from the wheel (into a venv that borrows this machine's packages, so no second torch), the server serves
the demo page and its files."""
from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.server_process import server_process

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, cwd=out)
    (built,) = out.glob("voxgate-*.whl")
    return built


def test_the_wheel_has_every_module_and_the_demo(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT).as_posix() for package in ("engine", "realtime")
               for path in (ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}
    demo = {"realtime/web/" + path.relative_to(ROOT / "web").as_posix()
            for path in (ROOT / "web").rglob("*") if path.is_file()}
    assert "realtime/web/index.html" in demo
    assert modules - names == set() and demo - names == set()


def test_installed_from_the_wheel_the_server_serves_the_demo(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, cwd=tmp_path)
    where = subprocess.run([str(python), "-c", "import realtime.app as app; print(app.__file__, app.WEB_DIR)"],
                           check=True, cwd=tmp_path, capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(env_dir)) for path in where), where  # the wheel's copy, not this checkout
    with server_process([], tmp_path / "server.log", python=str(python), cwd=tmp_path) as server:
        page, style = server.get("/"), server.get("/static/style.css")
        assert page[0] == 200 and b"<html" in page[1].lower() and style[0] == 200 and style[1]
        assert "voice-chat demo" in server.log()
