"""The `curl` examples of docs/gateway.md, run as written against a gateway and a simulated
worker: each block exits 0 and prints every text its `# expect:` lines name."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.gateway_harness import gateway, live_worker
from tests.service_harness import ROOT

DOC = ROOT / "docs" / "gateway.md"
SECTION = "## Examples with curl"


def curl_blocks() -> list[str]:
    text = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [b for b in blocks if "curl" in b]


def test_the_docs_have_curl_examples() -> None:
    blocks = curl_blocks()
    assert len(blocks) >= 4 and all("# expect: " in b for b in blocks)


def test_the_curl_examples_run_as_written(redis_url: str, tmp_path: Path) -> None:
    with live_worker(redis_url, "gw-curl"), gateway(redis_url) as url:
        for block in curl_blocks():
            env = {"PATH": "/usr/bin:/bin", "GATEWAY": url, "MODEL": "sim"}
            proc = subprocess.run(["bash", "-eu", "-c", block], capture_output=True, text=True,
                                  cwd=tmp_path, env=env, timeout=60)
            assert proc.returncode == 0, (block, proc.stdout, proc.stderr)
            for want in re.findall(r"^# expect: (.*)$", block, flags=re.M):
                assert want in proc.stdout, (block, want, proc.stdout)
