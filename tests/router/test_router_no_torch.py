"""The router never imports torch: tokenizer, chat template and model metadata load without it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import aiohttp

from tests.router.conftest import router_env, router_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs the router's real entry point (`python -m services.router`, as make run and compose
# do) and, when the process exits, writes which heavy modules it had imported.
_ENTRY = """
import atexit, json, runpy, sys
report = sys.argv.pop(1)
def write():
    with open(report, "w") as f:
        json.dump({m: m in sys.modules for m in ("torch", "safetensors")}, f)
atexit.register(write)
sys.argv[0] = "services.router"
runpy.run_module("services.router", run_name="__main__", alter_sys=True)
"""


def test_a_serving_router_process_never_imports_torch(module_nats, tmp_path):
    report = tmp_path / "modules.json"
    env = {**router_env(), "TANDEM_ROUTER_NATS_URL": module_nats.url}
    cmd = [sys.executable, "-c", _ENTRY, str(report), "--service-id", "no-torch", "--port", "0"]
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(_chat_without_workers(module_nats.url, "no-torch"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert json.loads(report.read_text()) == {"torch": False, "safetensors": False}


async def _chat_without_workers(nats_url: str, service_id: str) -> None:
    """Lists the model, then has a chat prompt tokenized (and refused: no worker is live)."""
    base = f"http://127.0.0.1:{await router_port(nats_url, service_id)}/v1"
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/models") as r:
            assert r.status == 200
        async with http.post(f"{base}/chat/completions", json=chat) as r:
            assert r.status == 503, await r.text()


def test_the_router_modules_and_its_tokenizer_load_without_torch():
    code = (
        "import sys\n"
        "import services.router.service, services.router.api.app\n"
        "from libs.common.engine.load.source import load_tokenizer\n"
        "tok, model_id, n = load_tokenizer('default')\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "assert model_id and n > 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
