"""The API's routing over real SQL and Redis: a rollout's share, readiness, stickiness, pins."""

from __future__ import annotations

import time
import uuid

import pytest

from api.errors import APIError
from api.router import Router
from shared import deployments, keys, rollouts

TTL_S = 0.05


@pytest.fixture
def model(db, tiny_model_dir):
    """A model with versions 1 (stable) and 2."""
    model_id = f"router-{uuid.uuid4().hex[:6]}"
    for version in ("1", "2"):
        deployments.register(db, model_id, str(tiny_model_dir), version=version)
    return model_id


def _ready(rdb, model_id: str, version: str, *, age_s: float = 0.0) -> None:
    """A worker of the version that beat as ready `age_s` ago."""
    name = keys.deployment_name(model_id, version)
    rdb.zadd(keys.ready_workers(name), {f"w-{uuid.uuid4().hex[:6]}": time.time() - age_s})


async def _versions(router: Router, model: str, n: int, **kwargs) -> list[str]:
    picks = []
    for i in range(n):
        tenant_id = kwargs.get("tenant_id", f"ten_{i}")
        deployment = await router.route(model, tenant_id, kwargs.get("user"))
        picks.append(deployment.version)
    return picks


async def test_a_ten_percent_canary_gets_ten_percent_of_a_thousand_requests(db, aredis, rdb, model):
    rollouts.start(db, model, "2", 10)
    _ready(rdb, model, "2")
    router = Router(db, aredis, TTL_S, ready_within_s=6)
    picks = await _versions(router, model, 1000)
    assert 70 <= picks.count("2") <= 130, picks.count("2")
    # Pinned: that version, whatever the weights.
    assert set(await _versions(router, f"{model}@1", 50)) == {"1"}
    assert set(await _versions(router, f"{model}@2", 50)) == {"2"}


async def test_a_canary_without_a_ready_worker_gets_nothing(db, aredis, rdb, model):
    rollouts.start(db, model, "2", 100)
    router = Router(db, aredis, TTL_S, ready_within_s=6)
    _ready(rdb, model, "2", age_s=7)  # its last beat is older than the heartbeat timeout
    assert set(await _versions(router, model, 20)) == {"1"}
    _ready(rdb, model, "2")
    time.sleep(TTL_S)
    assert set(await _versions(router, model, 20)) == {"2"}
    # A pin still reaches a version with no worker: the client asked for it.
    assert (await router.route(f"{model}@2", "ten_a", None)).version == "2"


async def test_sticky_routing_keeps_a_tenant_or_user_on_one_version(db, aredis, rdb, model):
    rollouts.start(db, model, "2", 50, sticky="user")
    _ready(rdb, model, "2")
    router = Router(db, aredis, TTL_S, ready_within_s=6)
    for user in ("alice", "bob", "carol", "dave"):
        assert len(set(await _versions(router, model, 20, tenant_id="ten_a", user=user))) == 1
    # Users spread over both versions (50%: 40 users on one version has odds 2**-39).
    per_user = [(await router.route(model, "ten_a", f"u{i}")).version for i in range(40)]
    assert set(per_user) == {"1", "2"}


async def test_a_change_reaches_the_router_within_its_cache_time(db, aredis, rdb, model):
    router = Router(db, aredis, TTL_S, ready_within_s=6)
    _ready(rdb, model, "2")
    assert set(await _versions(router, model, 10)) == {"1"}  # no rollout: stable
    rollouts.start(db, model, "2", 100)
    time.sleep(TTL_S)
    assert set(await _versions(router, model, 10)) == {"2"}
    rollouts.abort(db, model)
    time.sleep(TTL_S)
    assert set(await _versions(router, model, 10)) == {"1"}


async def test_an_unknown_model_or_version_is_a_404(db, aredis, model):
    router = Router(db, aredis, TTL_S, ready_within_s=6)
    for name in (f"{model}@9", f"{model}@", "no-such-model", "no-such-model@1"):
        with pytest.raises(APIError) as refused:
            await router.route(name, "ten_a", None)
        assert (refused.value.status_code, refused.value.code) == (404, "model_not_found")
