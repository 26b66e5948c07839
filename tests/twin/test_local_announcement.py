"""What ``make local`` prints for each committed stack, and for a taken port; nothing is started.

The models and their replica bounds come from the stack's render, as the
local run reads them; the expectations come from the stack's file, so a
stack that gains or loses a model at zero changes both sides.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from typing import Any

import yaml

from infra.render import ROOT
from tests.harness import SERVE_INGRESS, ray_services, stack_doc
from twin.local_announcement import Metrics, ServedModel, announcement, port_taken, served_models
from twin.local_run import free_port_after, needs_front_door

BASE = "http://127.0.0.1:8000/v1"
KEY = "twin-0123456789abcdef"


def served(stack: str, only: str | None = None) -> list[ServedModel]:
    return [
        model
        for rs in ray_services(stack)
        if only in (None, rs["metadata"]["name"])
        for model in served_models(rs["metadata"]["name"], yaml.safe_load(rs["spec"]["serveConfigV2"]))
    ]


def config_models(stack: str) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = stack_doc(stack)["config"]["llm-platform:models"]
    return models


def labelled(text: str, label: str) -> list[str]:
    return [line.split(label, 1)[1].strip() for line in text.splitlines() if line.strip().startswith(label)]


def notes_of(text: str) -> list[str]:
    """The lines after the curl example."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.strip().startswith("-H "))
    return [line.strip() for line in lines[start + 1 :] if line.strip()]


def zero_notes(stack: str, how: str) -> list[str]:
    """The note the stack's file says each of its models at zero gets, woken ``how`` (after "wakes it")."""
    at_zero = [m for m in config_models(stack) if m["autoscaling"]["min_replicas"] == 0]
    assert at_zero, f"the {stack} stack has a model at min_replicas 0"
    return [
        f"{m['model_id']} is at min_replicas 0: it goes to zero after {m['autoscaling']['downscale_delay_s']:g}s "
        f"without requests (its downscale_delay_s), and the next request wakes it{how} (a worker node and its "
        "engine start: about a minute)."
        for m in at_zero
    ]


def test_dev_prints_one_base_url_and_says_its_model_at_zero_wakes_through_the_gateway() -> None:
    models = served("dev")
    text = announcement(BASE, KEY, models)
    assert labelled(text, "OpenAI base URL:") == [BASE]
    assert labelled(text, "models:") == [", ".join(m["model_id"] for m in config_models("dev"))]
    expected = zero_notes("dev", " through the model gateway, which holds it")
    assert notes_of(text) == [*expected, "Ctrl-C stops everything."]
    # One RayService whose replicas run vLLM's own server: the front door gives them one address.
    assert [m.layout for m in models] == ["vllm-server"]
    assert needs_front_door(models)


def test_the_serve_ingress_example_names_its_model_at_zero_with_its_delay_and_no_gateway() -> None:
    models = served(SERVE_INGRESS)
    text = announcement(BASE, KEY, models)
    assert labelled(text, "OpenAI base URL:") == [BASE]
    assert notes_of(text) == [*zero_notes(SERVE_INGRESS, ""), "Ctrl-C stops everything."]
    assert "gateway" not in text
    # One RayService in the serve-ingress layout: its Serve proxy is the base URL, no front door.
    assert [m.layout for m in models] == ["serve-ingress"]
    assert not needs_front_door(models)


def test_prod_prints_one_base_url_for_every_model_and_no_note_about_zero() -> None:
    models = served("prod")
    metrics = [Metrics("http://127.0.0.1:41001/metrics", m.model_id) for m in models]
    text = announcement(BASE, KEY, models, metrics=metrics)
    assert labelled(text, "OpenAI base URL:") == [BASE]
    assert "another replica" not in text
    assert labelled(text, "models:") == [", ".join(m["model_id"] for m in config_models("prod"))]
    assert all(m["autoscaling"]["min_replicas"] >= 1 for m in config_models("prod"))
    assert "min_replicas 0" not in text and "to zero" not in text
    services = sorted(rs["metadata"]["name"] for rs in ray_services("prod"))
    assert notes_of(text) == [
        f"Deployed, each RayService ({', '.join(services)}) has its own endpoint; here one front door sends "
        "each request to the replicas of the model it names.",
        "Ctrl-C stops everything.",
    ]
    assert needs_front_door(models)


def test_one_service_of_prod_names_the_one_left_out_and_still_has_one_base_url() -> None:
    models = served("prod", "llama-31-8b")
    text = announcement(BASE, KEY, models, left_out=["llama-33-70b"])
    assert labelled(text, "OpenAI base URL:") == [BASE]
    assert labelled(text, "models:") == ["llama-3.1-8b-instruct"]
    assert notes_of(text) == [
        "Not running: the stack's RayService llama-33-70b (without --service every RayService runs).",
        "Ctrl-C stops everything.",
    ]
    # vLLM's own server in each replica, on a free port each: the front door gives them one address.
    assert needs_front_door(models)


def test_only_the_models_at_zero_are_named() -> None:
    config = {
        "applications": [
            {
                "name": "shared",
                "args": {
                    "models": [
                        {"model_id": "small", "autoscaling": {"min_replicas": 0, "downscale_delay_s": 300}},
                        {"model_id": "big", "autoscaling": {"min_replicas": 1}},
                        {"model_id": "plain"},
                    ]
                },
            }
        ]
    }
    models = served_models("shared", config)
    assert [(m.model_id, m.min_replicas, m.layout) for m in models] == [
        ("small", 0, "serve-ingress"),
        ("big", 1, "serve-ingress"),
        ("plain", 1, "serve-ingress"),
    ]
    zero = [line for line in notes_of(announcement(BASE, KEY, models)) if "min_replicas 0" in line]
    assert len(zero) == 1 and zero[0].startswith("small is at min_replicas 0: it goes to zero after 300s")


def test_the_key_and_the_metrics_are_printed_once_each() -> None:
    models = served("prod")
    metrics = [Metrics(f"http://127.0.0.1:{port}/metrics", "llama-3.1-8b-instruct") for port in (41001, 41003)]
    text = announcement(BASE, KEY, models, metrics=metrics)
    assert labelled(text, "API key:") == [KEY]
    assert f"curl {BASE}/chat/completions -H 'Authorization: Bearer {KEY}'" in text
    assert '"model": "llama-3.1-8b-instruct"' in text
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if "vLLM metrics:" in line)
    assert lines[first].endswith("http://127.0.0.1:41001/metrics (llama-3.1-8b-instruct)")
    assert lines[first + 1] == " " * 19 + "http://127.0.0.1:41003/metrics (llama-3.1-8b-instruct)"
    assert text.count("vLLM metrics:") == 1
    assert "metrics" not in announcement(BASE, KEY, models)


def test_a_taken_port_is_one_line_naming_it_and_how_to_pick_another() -> None:
    line = port_taken(8000, "prod", 8001)
    assert "\n" not in line
    assert line.startswith("127.0.0.1:8000 is taken (another program listens there)")
    assert "make local STACK=prod PORT=8001" in line and "python -m twin.local --stack prod --port 8001" in line
    denied = port_taken(80, "dev", 81, "Permission denied")
    assert "is taken" not in denied and "127.0.0.1:80 can not be listened on (Permission denied)" in denied
    assert "PORT=<port>" in port_taken(65535, "dev", None)


def test_make_local_on_a_taken_port_stops_with_that_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-m", "twin.local", "--stack", "dev", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"local: 127.0.0.1:{port} is taken"), done.stderr
    suggested = re.search(r"PORT=(\d+) \(python -m twin.local --stack dev --port (\d+)\)", lines[0])
    assert suggested is not None and suggested.group(1) == suggested.group(2) != str(port)


def test_the_suggested_port_is_free_and_above_the_taken_one() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        suggested = free_port_after(port)
    assert suggested is not None and suggested > port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", suggested))


def test_a_woken_vllm_server_model_is_said_to_wake_through_the_gateway() -> None:
    """Dev with routing and the gateway on: its model at zero runs vLLM's own server, and only the gateway wakes
    it (the local run runs the rendered gateway and router in front of it)."""
    from tests.harness import manifests_of, render_routed

    models = [
        m
        for rs in manifests_of(render_routed("dev"), "RayService")
        for m in served_models(rs["metadata"]["name"], yaml.safe_load(rs["spec"]["serveConfigV2"]))
    ]
    assert [m.layout for m in models] == ["vllm-server"] and models[0].min_replicas == 0
    (note, _) = notes_of(announcement(BASE, KEY, models))
    assert "the next request wakes it through the model gateway, which holds it (a worker node" in note
    assert needs_front_door(models)
