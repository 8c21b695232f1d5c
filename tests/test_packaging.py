"""The wheel carries everything `voxgate serve` needs: every module of engine/ and realtime/, and the browser demo.
Installed from the wheel (into a venv that borrows this machine's packages, so no second torch), the server serves
the demo page and its files."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.server_process import server_process

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(source: Path, out: Path, name: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, cwd=out)
    (built,) = out.glob(f"{name}-*.whl")
    return built


def borrowing_venv(env_dir: Path) -> Path:
    """A venv that sees the packages of the interpreter running the tests, whether that is the system's or a venv
    of its own (`system_site_packages` reaches only the base interpreter's: from a venv, nothing installed there),
    without running their .pth files, so that an editable install of this checkout stays out. Its python."""
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    borrowed = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(purelib) / "borrowed.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel"), "voxgate")


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
    python = borrowing_venv(env_dir)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, cwd=tmp_path)
    where = subprocess.run([str(python), "-c", "import realtime.app as app; print(app.__file__, app.WEB_DIR)"],
                           check=True, cwd=tmp_path, capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(env_dir)) for path in where), where  # the wheel's copy, not this checkout
    with server_process([], tmp_path / "server.log", python=str(python), cwd=tmp_path) as server:
        page, style = server.get("/"), server.get("/static/style.css")
        assert page[0] == 200 and b"<html" in page[1].lower() and style[0] == 200 and style[1]
        assert "voice-chat demo" in server.log()


CLIENT = ROOT / "clients" / "python"
SERVER_SIDE = ("torch", "engine", "realtime")


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory) -> Path:
    return build_wheel(CLIENT, tmp_path_factory.mktemp("client_wheel"), "voxgate_client")


def test_the_client_wheel_needs_neither_torch_nor_the_server(client_wheel):
    """An agent app installs the client and a plugin without a GPU stack: its requirements, extras included, name
    no torch and no voxgate, and the wheel holds the client's modules only."""
    with zipfile.ZipFile(client_wheel) as wheel:
        names = set(wheel.namelist())
        (metadata,) = [wheel.read(name).decode() for name in names if name.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip().lower() for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    assert sorted(r for r in requires if "extra ==" not in r) == ["numpy", "websockets>=13"]
    assert {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")} \
        == {"opus", "pipecat", "livekit"}
    assert not [r for r in requires if r.startswith(("torch", "voxgate"))]
    modules = {"voxgate_client/" + path.name for path in (CLIENT / "voxgate_client").glob("*.py")}
    assert "voxgate_client/pipecat.py" in modules and modules <= names
    assert not [name for name in names if name.startswith(tuple(package + "/" for package in SERVER_SIDE))]


def test_installed_from_its_wheel_the_client_and_plugins_import_without_torch(client_wheel, tmp_path):
    """torch, engine and realtime made unimportable, the installed client and both plugins still import."""
    env_dir = tmp_path / "venv"
    python = borrowing_venv(env_dir)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # nothing of this checkout
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(client_wheel)], check=True,
                   cwd=tmp_path, env=env)
    probe = ("import sys; sys.modules.update(dict.fromkeys(%r)); "
             "import voxgate_client.client, voxgate_client.protocol, voxgate_client.pipecat, voxgate_client.livekit; "
             "print(voxgate_client.client.__file__)") % (SERVER_SIDE,)
    where = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.strip().startswith(str(env_dir))  # the wheel's copy, not this checkout
