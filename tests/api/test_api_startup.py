"""The API's startup: tokenizers of the active deployments load before the first request."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from api.app import create_app


def test_active_deployments_tokenizers_load_at_startup_without_a_request(settings, tiny_deployment):
    # The first request for a deployment used to load its tokenizer (seconds on the real
    # model) while every request for it queued behind the load.
    with TestClient(create_app(settings)) as client:
        tokenizers = client.app_state["ctx"].tokenizers
        deadline_s = time.monotonic() + 60
        while not tokenizers.is_loaded(tiny_deployment) and time.monotonic() < deadline_s:
            time.sleep(0.05)
        assert tokenizers.is_loaded(tiny_deployment)
