"""scripts/device/packed.sh: what a device call's command writes under $OUT comes back as one archive, with the
command's exit status."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_commands_files_come_back_in_one_archive_with_its_status(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    command = 'echo report > "$OUT/a.json"; mkdir "$OUT/trace"; echo 1 > "$OUT/trace/t-1.jsonl"; exit 3'
    done = subprocess.run(["bash", "scripts/device/packed.sh", "bash", "-c", command], cwd=ROOT, timeout=60,
                          env={"OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 3
    assert sorted(p.name for p in out.iterdir()) == ["all.tgz"]
    with tarfile.open(out / "all.tgz") as archive:
        names = {name.lstrip("./") for name in archive.getnames()}
        assert {"a.json", "trace/t-1.jsonl"} <= names
        assert archive.extractfile("./a.json").read() == b"report\n"
