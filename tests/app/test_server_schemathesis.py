"""schemathesis against /openapi.json: generated (valid and invalid) requests to every route never get a 5xx,
and every response, errors included, has the status, content type and shape the schema documents."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(smollm2_path):
    from app.server.app import ServerThread, create_app
    from app.server.security import ServerSettings
    from engine.engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(smollm2_path), ctx_size=256, max_seqs=4, max_queue=64))
    # generation is capped at 2 tokens so that thousands of generated requests finish on a CPU
    srv = ServerThread(create_app(eng, ServerSettings(max_tokens_limit=2, max_body_bytes=256 * 1024))).start()
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.mark.slow
def test_schemathesis_no_5xx_and_documented_errors(server, tmp_path):
    exe = Path(sys.executable).with_name("schemathesis")
    cmd = [str(exe)] if exe.exists() else [shutil.which("schemathesis") or "schemathesis"]
    seconds = os.environ.get("HIVEJET_SCHEMATHESIS_SECONDS", "60")
    r = subprocess.run(cmd + ["run", server.url + "/openapi.json",
                              "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                                          "response_schema_conformance,response_headers_conformance",
                              "-n", "10", "--max-time", seconds, "-w", "1", "--request-timeout", "60",
                              "--generation-deterministic", "--continue-on-failure"],
                       capture_output=True, text=True, timeout=int(seconds) + 120, cwd=tmp_path)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failures" not in r.stdout.split("SUMMARY")[-1].lower(), tail
