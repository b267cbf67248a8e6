"""Shared by the server's tests: the demo model with a chat template, a uvicorn server in a thread, an `openai`
client, and a bounded wait."""

import threading
import time
from contextlib import contextmanager

import openai
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_blockdiff.assets import demo_model_path
from hf_blockdiff.config import BlockDiffusionConfig

CFG = BlockDiffusionConfig(strategy="low_confidence_dynamic", threshold=0.9, max_new_tokens=32)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model and a copy of its tokenizer with a chat template (its vocabulary: digits, letters, + = space)."""
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


@contextmanager
def running(app):
    """The app served by uvicorn in a thread on a free port of 127.0.0.1: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def client(url, key="none", **options):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, **options)


def wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
