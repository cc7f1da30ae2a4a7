"""mashbox.testing and its pytest plugin, as another project uses them: a throwaway project
whose test asks for `mashbox_server` and talks to it with the openai SDK, run by pytest in a
subprocess (the plugin found through its entry point), on mashbox-tiny (no download)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx

from mashbox.testing import running_server

THROWAWAY_TEST = """
import openai


def test_a_seeded_answer_repeats(mashbox_server, mashbox_api_key):
    assert mashbox_server.startswith("http://127.0.0.1:")
    client = openai.OpenAI(base_url=mashbox_server + "/v1", api_key=mashbox_api_key)
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
               temperature=1.0, seed=7)
    first = client.chat.completions.create(**ask).choices[0].message.content
    assert first and client.chat.completions.create(**ask).choices[0].message.content == first


def test_the_key_is_required(mashbox_server):
    client = openai.OpenAI(base_url=mashbox_server + "/v1", api_key="wrong", max_retries=0)
    try:
        client.models.list()
    except openai.AuthenticationError:
        return
    raise AssertionError("a wrong key was accepted")
"""


def test_another_projects_tests_get_a_real_server(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_with_mashbox.py").write_text(textwrap.dedent(THROWAWAY_TEST))
    (project / "pytest.ini").write_text("[pytest]\n")  # its own rootdir, not mashbox's
    env = {**os.environ, "MASHBOX_MODELS_DIR": str(tmp_path / "models")}  # built on first use
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mashbox-key=k-1"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout
    assert (tmp_path / "models" / "mashbox-tiny" / "mashbox-tiny.gguf").is_file()


def test_running_server_with_a_key_and_flags(tmp_path):
    env = {"MASHBOX_MODELS_DIR": str(tmp_path / "models")}
    with running_server("mashbox-tiny", "--slots", "2", key="k-2", env=env) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        r = httpx.get(server.url + "/v1/models", headers={"x-api-key": "k-2"})
        assert r.status_code == 200 and r.json()["data"][0]["slots"] == 2
        assert any("ready in" in line for line in server.lines)
        url = server.url
    try:  # stopped when the block ended
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return
    raise AssertionError("the server still answers after the block")
