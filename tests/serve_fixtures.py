"""`mm-encoder serve` in a subprocess for the tests that run whole graphs, and the request they send."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from mm_encoder.deploy.local import leftover_pids

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "mm_encoder" / "samples" / "sample.jpg"
# The request below: the 1280x720 sample is 1196 tokens for `tiny` (preprocess.num_tokens; checked in
# test_sample_token_count), the chat template and "What is in this image?" 27 more in the test LLM.
IMAGE_TOKENS, TEXT_TOKENS = 1196, 27


def chat(port: int) -> dict:
    image = base64.b64encode(SAMPLE.read_bytes()).decode()
    body = {"model": "mm-chat", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{image}"}}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


class Served:
    """`mm-encoder serve` in a subprocess; one thread collects everything it prints."""

    def __init__(self, graph: str, run_dir: Path, port: int, *extra: str, env: dict[str, str] | None = None):
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mm_encoder.cli", "serve", str(ROOT / graph), "--run-dir", str(run_dir),
             "--port", str(port), "--status-interval", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while needle not in self.text:
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self.reader.is_alive()):
                raise AssertionError(f"no {needle!r} in serve's output:\n{self.text[-4000:]}")
            time.sleep(0.05)
        return self.text

    def stop(self) -> str:
        state = json.loads((self.run_dir / "state.json").read_text())
        groups = {c["pid"] for c in state["components"]}
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(120) == 0, self.text
        self.reader.join(10)
        assert "no processes left" in self.text, self.text
        assert leftover_pids(groups) == []
        return self.text
