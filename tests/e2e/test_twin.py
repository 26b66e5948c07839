"""End-to-end: the local twin of each committed stack passes (`make twin`), and the local run answers (`make local`).

Each twin renders the stack, runs Ray's own checks and a local multi-node
cluster shaped like every RayService (under 10 minutes a stack on two
cores). The tiny model is the one the server test built (build/tiny-model).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import openai
import pytest

from infra.render import ROOT
from localserve.processes import Child, child_env, free_port, marked_processes, session_members
from tests.e2e import twin_log
from tests.harness import SERVE_INGRESS
from twin import observe

pytestmark = pytest.mark.e2e

# The monitored twins run as `make twin` does, their monitoring included (a real Prometheus on the
# render's monitors and rules, each alert fired by its own fault: twin/observe.py), and this test
# checks their lines: dev's serve-ingress variant about 10 min, prod about 7, on a quiet two-core
# machine. TWIN_MONITORING=0 leaves the monitoring out (about 4 min a stack) for a quicker local run.
# Dev itself runs the fast layout at zero behind the gateway (the woken session, below); its file
# with `serving.layout: serve-ingress` is the one live run of Serve's OpenAI ingress and its alerts.
MONITORED_TWINS = (SERVE_INGRESS, "prod")
MONITORED = set() if os.environ.get("TWIN_MONITORING") == "0" else set(MONITORED_TWINS)
TWIN_TIMEOUT_S = {twin: 1200.0 if twin in MONITORED else 600.0 for twin in MONITORED_TWINS}
LOCAL_READY_TIMEOUT_S = 600.0


def test_the_overloads_chat_and_answer_fit_the_tiny_models_context(tiny_model: Path) -> None:
    # vLLM refuses (400) a request whose prompt and max_tokens pass max_model_len; the overload's
    # streams would then fail instead of filling the KV cache.
    from transformers import AutoTokenizer

    from localserve.server import MAX_MODEL_LEN

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    # StreamLoad(distinct=True) puts the request's number in front; the overload sends fewer than 10,000.
    chat = [{"role": "user", "content": f"9999 {observe.OVERLOAD_PROMPT}"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
    tokens = len(prompt["input_ids"])
    assert tokens > 256, f"the overload's prompt is {tokens} tokens: not a long prompt"
    assert tokens + max(observe.OVERLOAD_MAX_TOKENS, observe.OVERLOAD_MAX_TOKENS_INGRESS) <= MAX_MODEL_LEN


def _serve_ingress_dev(directory: Path) -> Path:
    """Dev's stack file on Serve's OpenAI ingress (tests/harness.py SERVE_INGRESS), written for `--config`."""
    import yaml

    from tests.harness import serve_ingress_doc

    config = directory / "Pulumi.dev.yaml"
    config.write_text(yaml.safe_dump(serve_ingress_doc()))
    return config


@pytest.mark.parametrize("twin", MONITORED_TWINS)
def test_the_monitored_twin_passes(twin: str, tiny_model: Path, tmp_path: Path) -> None:
    stack, _, variant = twin.partition("-")
    argv = ["infra.twin", "--stack", stack, "--out", str(tmp_path / "render")]
    if variant:
        argv += ["--config", str(_serve_ingress_dev(tmp_path))]
    done = twin_log.run(
        [*argv, *(["--monitoring"] if twin in MONITORED else [])], tmp_path / "twin.log", TWIN_TIMEOUT_S[twin] + 60
    )
    done.assert_passed(f"twin {twin}")
    output, verdicts, took = done.output, done.verdicts, done.seconds
    assert took < TWIN_TIMEOUT_S[twin], f"the {twin} twin took {took:.0f}s"
    assert any(v.startswith("PASS") and "traces: request" in v for v in verdicts), "no trace line"
    if twin in MONITORED:
        # Every alert with a fault here fired on it; the rest said why not (a `--` line).
        fired = {
            a for a in observe.FAULT_OF if any(v.startswith("PASS") and f"alert {a}: fired" in v for v in verdicts)
        }
        explained = {
            a
            for a in observe.FAULT_OF
            if any(f"alert {a}: fault " in line and "not run in this layout" in line for line in output.splitlines())
        }
        assert set(observe.FAULT_OF) <= fired | explained, sorted(set(observe.FAULT_OF) - fired - explained)
        assert any("steady state: no alert fired" in v for v in verdicts)
        assert any("series: all" in v for v in verdicts) and any("panels: all" in v for v in verdicts)
    if variant:
        # Serve's ingress wakes the model from zero and lets it go again.
        assert any("ingress (" in v for v in verdicts)
        assert any("wake (" in v for v in verdicts) and any("scale to zero (" in v for v in verdicts)
    else:
        # Both prod services run the vllm-server layout: each model's servers, no ingress.
        replicas = [v for v in verdicts if "replicas (" in v]
        assert len(replicas) == 2 and all("2 servers" in v for v in replicas), replicas
        assert not any("ingress (" in v for v in verdicts)
        # The request router in front of each model's two replicas (twin/routing.py).
        spread = [v for v in verdicts if v.startswith("PASS") and "through the router (round_robin)" in v]
        assert len(spread) == 2, spread


# Dev's model woken by the gateway: about 3 min, no monitoring (twin/wake.py).
WOKEN_TIMEOUT_S = 480.0


def test_the_twin_of_dev_wakes_its_model_through_the_gateway_and_lets_it_sleep(tmp_path: Path) -> None:
    """Dev as committed: the fast layout with routing and the gateway on, its model at min_replicas 0.

    The woken session: at zero, a request through the rendered gateway and router wakes it (a new node,
    one replica), the next goes straight through, and once idle the model and its node are gone again.
    """
    argv = ["infra.twin", "--stack", "dev", "--out", str(tmp_path / "r")]
    done = twin_log.run(argv, tmp_path / "twin.log", WOKEN_TIMEOUT_S + 60)
    done.assert_passed("twin dev")
    verdicts, took = done.verdicts, done.seconds
    passed = [v for v in verdicts if v.startswith("PASS")]
    for line in ("at zero (", "wake (", "the next request, awake", "scale to zero (", "back to no worker"):
        assert any(line in v for v in passed), line
    assert took < WOKEN_TIMEOUT_S, f"the woken twin took {took:.0f}s"


def _announced(child: Child) -> tuple[str, str] | None:
    text = child.log_path.read_text(errors="replace")
    url = re.search(r"OpenAI base URL: (\S+)", text)
    key = re.search(r"API key:\s+(\S+)", text)
    return (url.group(1), key.group(1)) if url and key else None


def test_make_local_answers_the_openai_client_and_stops_on_ctrl_c(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "twin.local", "--stack", "dev", "--port", str(port), "--model-dir", str(tiny_model)]
    child = Child.start("local", argv, child_env({"PYTHONPATH": str(ROOT)}), tmp_path / "local.log")
    try:
        deadline = time.monotonic() + LOCAL_READY_TIMEOUT_S
        while (found := _announced(child)) is None:
            assert child.proc.poll() is None, child.log_tail()
            assert time.monotonic() < deadline, child.log_tail()
            time.sleep(2)
        base_url, api_key = found
        assert base_url == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=120, max_retries=0)
        models = [m.id for m in client.models.list().data]
        answer = client.chat.completions.create(
            model=models[0],
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0).models.list()
        child.proc.send_signal(signal.SIGINT)
        assert child.proc.wait(timeout=120) == 0, child.log_tail()
        # Everything the run started is gone with it: its own processes and its cluster's.
        files = re.search(r"cluster files: (\S+)", child.log_path.read_text(errors="replace"))
        assert files is not None, child.log_tail()
        deadline = time.monotonic() + 60
        while (session_members(child.proc.pid) or marked_processes(files.group(1))) and time.monotonic() < deadline:
            time.sleep(1)
        assert session_members(child.proc.pid) == [] and marked_processes(files.group(1)) == [], child.log_tail()
    finally:
        child.stop()
