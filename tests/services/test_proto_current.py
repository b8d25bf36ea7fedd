"""The committed generated code in services/proto/ is what `make proto` makes now."""

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_generated_code_matches_a_fresh_make_proto(tmp_path):
    # The Makefile's own recipe, into a temporary output root; `-o` keeps make from
    # re-running `setup` (pip) for the stamp file, PY points at this interpreter.
    subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            ".venv/.installed-stamp",
            "proto",
            f"PROTO_OUT={tmp_path}",
            f"PY={sys.executable}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    fresh = sorted(p.name for p in (tmp_path / "services" / "proto").iterdir())
    committed = sorted(
        p.name for p in (ROOT / "services" / "proto").iterdir() if p.name.endswith(GENERATED)
    )
    protos = sorted(p.stem for p in (ROOT / "protos").glob("*.proto"))
    assert (
        fresh == committed == sorted(f"{stem}{suffix}" for stem in protos for suffix in GENERATED)
    )
    for name in fresh:
        assert filecmp.cmp(
            tmp_path / "services" / "proto" / name,
            ROOT / "services" / "proto" / name,
            shallow=False,
        ), f"services/proto/{name} is stale: run `make proto`"


def test_generated_grpc_code_imports_its_messages_as_a_package_module():
    from services.proto import teacher_pb2, teacher_pb2_grpc

    assert teacher_pb2_grpc.services_dot_proto_dot_teacher__pb2 is teacher_pb2
