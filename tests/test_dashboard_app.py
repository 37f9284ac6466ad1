"""The dashboard over HTTP, mounted by the gateway at /dashboard behind its keys: who may look
and who may act, CSRF on the writes, what a page escapes and never shows. A real redis-server;
no worker (the jobs are written by hand)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx2
import pytest
import redis

from qworker_client.protocol import Keys
from tests.gateway_harness import gateway

KEYS = Keys()
API_KEY, ADMIN_KEY = "sk-viewer-0123456789", "sk-admin-9876543210"
SCRIPT = "<script>window.__pwned=1</script>"


@pytest.fixture
def board(redis_url: str) -> Iterator[str]:
    with gateway(redis_url, api_keys=(API_KEY,), admin_keys=(ADMIN_KEY,)) as base:
        yield f"{base}/dashboard"


def login(board: str, key: str) -> httpx2.Client:
    client = httpx2.Client(base_url=board, follow_redirects=False)
    reply = client.post("/login", data={"key": key})
    assert reply.status_code == 303, reply.text
    return client


def csrf(client: httpx2.Client, path: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', client.get(path).text)
    assert found, f"no CSRF token on {path}"
    return found.group(1)


def dead_letter(redis_url: str, job_id: str = "bad1", code: str = "invalid_job") -> str:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    entry = client.xadd(KEYS.dead, {"reason": "not a valid job: max_tokens", "code": code,
                                    "source": KEYS.jobs, "source_id": "1-0", "worker": "w1",
                                    "id": job_id, "prompt": "hi", "max_tokens": "4"})
    client.close()
    return str(entry)


def test_a_visitor_without_a_key_is_sent_to_log_in(board: str) -> None:
    for path in ("/", "/workers", "/jobs", "/dead", "/jobs/x1"):
        reply = httpx2.get(board + path, follow_redirects=False)
        assert reply.status_code == 303 and reply.headers["location"].endswith("/login")
    bare = httpx2.get(board, follow_redirects=True)  # /dashboard, no slash
    assert bare.status_code == 200 and bare.url.path == "/dashboard/login"
    bad = httpx2.post(board + "/login", data={"key": "sk-wrong"})
    assert bad.status_code == 401


def test_an_api_key_looks_but_may_not_act(board: str, redis_url: str) -> None:
    entry = dead_letter(redis_url)
    viewer = login(board, API_KEY)
    for path in ("/", "/workers", "/jobs", "/dead", "/jobs/bad1"):
        assert viewer.get(path).status_code == 200, path
    assert "/dead/retry" not in viewer.get("/dead").text  # no admin form shown
    token = csrf(login(board, ADMIN_KEY), "/dead")  # even with a (foreign) token: refused
    reply = viewer.post("/dead/retry", data={"entry": entry, "csrf": token})
    assert reply.status_code == 403 and "admin" in reply.text
    bearer = httpx2.post(board + "/dead/purge", data={"confirm": "purge", "code": ""},
                         headers={"authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 403
    assert redis.Redis.from_url(redis_url).xlen(KEYS.dead) == 1


def test_an_admin_write_needs_its_csrf_token(board: str, redis_url: str) -> None:
    entry = dead_letter(redis_url)
    admin = login(board, ADMIN_KEY)
    assert admin.post("/dead/retry", data={"entry": entry}).status_code == 403
    assert admin.post("/dead/retry", data={"entry": entry, "csrf": "0" * 40}).status_code == 403
    assert redis.Redis.from_url(redis_url).xlen(KEYS.dead) == 1
    reply = admin.post("/dead/retry", data={"entry": entry, "csrf": csrf(admin, "/dead")})
    assert reply.status_code == 303 and "queued+again%3A+1" in reply.headers["location"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.xlen(KEYS.dead) == 0
    assert client.xrange(KEYS.jobs)[0][1]["id"] == "bad1"


def test_retry_all_of_a_reason_leaves_the_others(board: str, redis_url: str) -> None:
    dead_letter(redis_url, "e1", "expired")
    dead_letter(redis_url, "e2", "expired")
    dead_letter(redis_url, "p1", "poison")
    admin = login(board, ADMIN_KEY)
    reply = admin.post("/dead/retry", data={"code": "expired", "csrf": csrf(admin, "/dead")})
    assert "queued+again%3A+2" in reply.headers["location"]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert [f["id"] for _, f in client.xrange(KEYS.dead)] == ["p1"]
    assert sorted(f["id"] for _, f in client.xrange(KEYS.jobs)) == ["e1", "e2"]


def test_purge_is_confirmed(board: str, redis_url: str) -> None:
    dead_letter(redis_url, "a1")
    dead_letter(redis_url, "a2")
    admin = login(board, ADMIN_KEY)
    token = csrf(admin, "/dead")
    admin.post("/dead/purge", data={"csrf": token, "code": "", "confirm": ""})
    assert redis.Redis.from_url(redis_url).xlen(KEYS.dead) == 2
    reply = admin.post("/dead/purge", data={"csrf": token, "code": "", "confirm": "purge"})
    assert "purged+2" in reply.headers["location"]
    assert redis.Redis.from_url(redis_url).xlen(KEYS.dead) == 0


def test_cancel_flags_a_job_and_leaves_an_ended_one(board: str, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.xadd(KEYS.jobs, {"id": "c1", "prompt": "hi"})
    client.xadd(KEYS.out("c2"), {"type": "error", "code": "cancelled", "message": "m"})
    admin = login(board, ADMIN_KEY)
    token = csrf(admin, "/jobs/c1")
    assert "flash=cancelling" in admin.post("/jobs/c1/cancel",
                                            data={"csrf": token}).headers["location"]
    assert client.exists(KEYS.cancel("c1"))
    assert "already+ended" in admin.post("/jobs/c2/cancel",
                                         data={"csrf": token}).headers["location"]
    assert not client.exists(KEYS.cancel("c2"))


def test_pages_escape_what_jobs_hold_and_show_no_secret(board: str, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.xadd(KEYS.jobs, {"id": "x1", "prompt": SCRIPT, "api_key": "sk-in-a-job-field",
                            "model": SCRIPT})
    entry = client.xrange(KEYS.jobs)[0][0]
    client.set(KEYS.submitted("x1"), entry)
    client.xadd(KEYS.dead, {"reason": SCRIPT, "code": "invalid_job", "source": KEYS.jobs,
                            "source_id": "1-0", "worker": SCRIPT, "id": "x2", "prompt": SCRIPT})
    client.xadd(KEYS.out("x1"), {"type": "token", "i": "0", "token_id": "1", "text": SCRIPT})
    admin = login(board, ADMIN_KEY)
    for path in ("/", "/jobs", "/jobs/x1", "/jobs/x2", "/dead", "/workers"):
        reply = admin.get(path)
        assert reply.status_code == 200, path
        assert "<script>window" not in reply.text, path
        for secret in (API_KEY, ADMIN_KEY, "sk-in-a-job-field"):
            assert secret not in reply.text, (path, secret)
        assert "script-src 'self'" in reply.headers["content-security-policy"]
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in admin.get("/jobs/x1").text


def test_the_session_cookie_holds_no_key(board: str) -> None:
    admin = login(board, ADMIN_KEY)
    cookie = next(iter(admin.cookies.jar))
    assert cookie.value.startswith("admin.") and ADMIN_KEY not in cookie.value
    assert cookie.has_nonstandard_attr("HttpOnly") or "httponly" in str(cookie._rest).lower()


def test_the_api_stays_behind_its_keys(board: str) -> None:
    base = board.removesuffix("/dashboard")
    assert httpx2.get(f"{base}/v1/models").status_code == 401
    assert httpx2.get(f"{base}/v1/models",
                      headers={"authorization": f"Bearer {API_KEY}"}).status_code == 200
