"""The API's cache of verified keys' principals (api/context.py `PrincipalCache`): valid for
one principals' epoch and a TTL; pure."""

from __future__ import annotations

from api.context import PrincipalCache
from shared.tenants import Principal

ALICE = Principal(tenant_id="t-alice", tenant_name="alice")


def test_a_principal_is_served_while_its_epoch_holds_and_looked_up_again_once_it_moves():
    cache = PrincipalCache(ttl_s=60)
    assert cache.get("h", epoch=3, now_s=0) is None
    cache.put("h", ALICE, epoch=3, now_s=0)
    assert cache.get("h", epoch=3, now_s=1) is ALICE
    assert cache.get("h", epoch=4, now_s=2) is None  # a key revoked, a tenant changed
    assert cache.get("h", epoch=3, now_s=3) is None  # the old epoch's entries are gone


def test_a_lookup_that_read_an_older_epoch_is_not_kept():
    cache = PrincipalCache()
    assert cache.get("h", epoch=1, now_s=0) is None
    assert cache.get("other", epoch=2, now_s=0) is None  # the epoch moved meanwhile
    cache.put("h", ALICE, epoch=1, now_s=0)  # looked up before the change
    assert cache.get("h", epoch=2, now_s=0) is None


def test_a_principal_is_looked_up_again_after_its_ttl_and_the_cache_stays_bounded():
    cache = PrincipalCache(ttl_s=60, max_num_entries=2)
    cache.get("a", epoch=0, now_s=0)
    cache.put("a", ALICE, epoch=0, now_s=0)
    assert cache.get("a", epoch=0, now_s=61) is None
    for key_hash in ("b", "c", "d"):
        cache.put(key_hash, ALICE, epoch=0, now_s=100)
    assert sum(cache.get(k, epoch=0, now_s=100) is not None for k in "abcd") <= 2
