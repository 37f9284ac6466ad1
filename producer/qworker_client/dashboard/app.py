"""The dashboard's ASGI app (Starlette): pages rendered on the server from `reads`, a little plain
JavaScript for the live stream, and the admin's writes, each an existing protocol operation (the
cancel script, the dead letters' retry script, XDEL of dead letters). Mounted by the gateway at
`/dashboard`, or served alone by `qworker dashboard`."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from qworker_client import dead as dead_letters
from qworker_client.client import Producer
from qworker_client.connect import DEFAULT_RESULT_TTL_S, ClientOptions
from qworker_client.dashboard import live, reads
from qworker_client.dashboard.access import COOKIE, SESSION_S, Access, Role
from qworker_client.dashboard.directory import REFRESH_S, Directory
from qworker_client.dashboard.view import FILTERS
from qworker_client.job_slots import job_view, slot_views
from qworker_client.protocol import DEFAULT_PREFIX, ID_PATTERN, Keys, is_valid_id

HERE = Path(__file__).parent
STATUSES = ("running", "queued", "delayed", "done", "error", "dead")
_CODE = re.compile(r"^[a-z0-9_]{0,64}$")


@dataclass
class Dashboard:
    producer: Producer
    access: Access
    templates: jinja2.Environment
    directory: Directory  # the keys found by SCAN, found again in a thread of its own

    @property
    def client(self) -> redis.Redis:
        return self.producer.redis

    def views(self) -> list[Keys]:
        """Each model's view of the keys on a Cluster (one Redis: the keys)."""
        return slot_views(self.client, self.producer.keys, self.directory.found().streams)

    def job_keys(self, job_id: str) -> Keys:
        """The keys of a job (on a Cluster, of the model whose slot holds it)."""
        return job_view(self.client, self.producer.keys, job_id, self.directory.found().streams)


def create_dashboard(redis_url: str, prefix: str = DEFAULT_PREFIX,
                     api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = (),
                     result_ttl_s: int = DEFAULT_RESULT_TTL_S,
                     refresh_s: float = REFRESH_S) -> Starlette:
    templates = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                   autoescape=True)
    templates.filters.update(FILTERS)
    producer = Producer(redis_url, prefix, options=ClientOptions(result_ttl_s=result_ttl_s))
    board = Dashboard(producer, Access(api_keys, admin_keys), templates,
                      Directory(producer.redis, producer.keys, refresh_s))

    def page(handler: Callable[[Dashboard, Request], Awaitable[Response]], admin: bool = False
             ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            role = board.access.role(request)
            if role is None:
                return RedirectResponse(_base(request) + "/login", 303)
            if request.method == "POST":
                if admin and role != "admin":
                    return _refused(board, request, 403, "only an admin key may do this")
                if not await _csrf_ok(board, request):
                    return _refused(board, request, 403, "the form's CSRF token is not right "
                                    "(reload the page and try again)")
            request.state.role = role
            try:
                return await handler(board, request)
            except redis.exceptions.NoPermissionError:
                return _refused(board, request, 503, "this Redis user may not read what the "
                                "dashboard shows: give it the operator ACL user "
                                "(docs/operating.md, \"ACL users\")")
            except redis.RedisError as exc:
                return _refused(board, request, 503,
                                f"the queue is unreachable ({type(exc).__name__})")
        return endpoint

    def open_page(handler: Callable[[Dashboard, Request], Awaitable[Response]]
                  ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await handler(board, request)
        return endpoint

    routes = [
        Route("/", page(_overview)),
        Route("/workers", page(_workers)),
        Route("/jobs", page(_jobs)),
        Route("/jobs/{job_id}", page(_job)),
        Route("/jobs/{job_id}/events", page(_events)),
        Route("/jobs/{job_id}/cancel", page(_cancel, admin=True), methods=["POST"]),
        Route("/dead", page(_dead)),
        Route("/dead/retry", page(_retry, admin=True), methods=["POST"]),
        Route("/dead/purge", page(_purge, admin=True), methods=["POST"]),
        Route("/login", open_page(_login), methods=["GET", "POST"]),
        Route("/logout", open_page(_logout), methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.dashboard = board
    return app


def render(board: Dashboard, request: Request, name: str, http_status: int = 200,
           **context: Any) -> HTMLResponse:
    role: Role | None = getattr(request.state, "role", None)
    html = board.templates.get_template(name).render(
        base=_base(request), role=role, open=board.access.open,
        csrf=board.access.csrf_token(request), flash=request.query_params.get("flash", ""),
        flash_error=request.query_params.get("error", ""), **context)
    return HTMLResponse(html, http_status, headers=_SECURITY_HEADERS)


_SECURITY_HEADERS = {
    # no inline script runs, whatever a page holds: only the dashboard's own file
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def _refused(board: Dashboard, request: Request, status: int, why: str) -> HTMLResponse:
    return render(board, request, "error.html", status, message=why)


async def _csrf_ok(board: Dashboard, request: Request) -> bool:
    if request.headers.get("authorization", "").lower().startswith("bearer "):
        return True  # a script's key is not sent by a browser on its own: no CSRF
    form = await request.form()
    return board.access.csrf_ok(request, str(form.get("csrf", "")))


def _back(request: Request, path: str, **query: str) -> RedirectResponse:
    shown = {k: v[:300] for k, v in query.items() if v}
    return RedirectResponse(_base(request) + path + ("?" + urlencode(shown) if shown else ""),
                            303)


# ---------------------------------------------------------------- pages


async def _overview(board: Dashboard, request: Request) -> Response:
    data = await run_in_threadpool(lambda: reads.overview(board.client, board.producer.keys,
                                                       found=board.directory.found()))
    return render(board, request, "overview.html", data=data, page="overview")


async def _workers(board: Dashboard, request: Request) -> Response:
    data = await run_in_threadpool(lambda: reads.workers(board.client, board.producer.keys,
                                                       found=board.directory.found()))
    return render(board, request, "workers.html", data=data, page="workers")


async def _jobs(board: Dashboard, request: Request) -> Response:
    query = request.query_params
    wanted = query.get("id", "").strip()
    if wanted:
        if not is_valid_id(wanted):
            return _back(request, "/jobs", error=f"not a job id (want {ID_PATTERN})")
        return RedirectResponse(f"{_base(request)}/jobs/{wanted}", 303)
    status = query.get("status", "") if query.get("status", "") in STATUSES else ""
    model = query.get("model", "")[:200]
    data = await run_in_threadpool(lambda: reads.jobs(board.client, board.producer.keys, status,
                                                      model, board.directory.found()))
    return render(board, request, "jobs.html", data=data, page="jobs", statuses=STATUSES,
                  status=status, model=model)


async def _job(board: Dashboard, request: Request) -> Response:
    job_id = request.path_params["job_id"]
    if not is_valid_id(job_id):
        return _refused(board, request, 404, f"not a job id (want {ID_PATTERN})")
    data = await run_in_threadpool(lambda: reads.job(board.client, board.job_keys(job_id),
                                                     job_id, found=board.directory.found()))
    return render(board, request, "job.html", job=data, page="jobs")


async def _events(board: Dashboard, request: Request) -> Response:
    job_id = request.path_params["job_id"]
    if not is_valid_id(job_id):
        return Response("not a job id\n", 404)
    after = request.headers.get("last-event-id") or request.query_params.get("after", "0-0")
    index = request.query_params.get("i", "0")
    if not re.fullmatch(r"[0-9]{1,20}-[0-9]{1,20}", after) or not index.isdigit():
        return Response("bad resume point\n", 400)
    if not live.try_open():
        return Response("too many live streams; retry later\n", 503,
                        headers={"retry-after": "5"})
    keys = await run_in_threadpool(board.job_keys, job_id)
    frames = live.events(board.client, keys, job_id, after, int(index))
    return StreamingResponse(frames, media_type="text/event-stream",
                             headers={"cache-control": "no-store", "x-accel-buffering": "no"})


async def _dead(board: Dashboard, request: Request) -> Response:
    code = request.query_params.get("code", "")
    code = code if _CODE.fullmatch(code) else ""
    data = await run_in_threadpool(lambda: reads.dead(board.client, board.views(), code))
    return render(board, request, "dead.html", data=data, page="dead", code=code)


# ---------------------------------------------------------------- writes (admin)


async def _cancel(board: Dashboard, request: Request) -> Response:
    job_id = request.path_params["job_id"]
    if not is_valid_id(job_id):
        return _refused(board, request, 404, f"not a job id (want {ID_PATTERN})")
    keys = await run_in_threadpool(board.job_keys, job_id)
    flagged = await run_in_threadpool(board.producer.cancel, job_id, None, keys.slot)
    if flagged:
        return _back(request, f"/jobs/{job_id}", flash="cancelling: it ends with finish "
                                                       "reason cancelled")
    return _back(request, f"/jobs/{job_id}", error="it has already ended: left alone")


async def _retry(board: Dashboard, request: Request) -> Response:
    """One dead letter (`entry`), or the newest RETRY_ALL_MAX of a code (`code`)."""
    form = await request.form()
    entry, code = str(form.get("entry", "")), str(form.get("code", ""))
    client, ttl = board.client, board.producer.options.result_ttl_s

    def retry() -> tuple[int, list[str]]:
        letters: list[tuple[Keys, dead_letters.DeadLetter]] = []
        for keys in board.views():  # on a Cluster, each model's dead letters
            if entry:
                found = dead_letters.find(client, keys, entry)
                if found is not None and found.entry_id == entry:
                    letters.append((keys, found))
            elif _CODE.fullmatch(code) and code:
                letters += [(keys, letter) for letter in
                            dead_letters.newest(client, keys, reads.RETRY_ALL_MAX, code)]
            else:
                return 0, ["say which dead letter, or which reason"]
        if entry and not letters:
            return 0, [f"no dead letter {entry!r}"]
        done, failed = 0, []
        for keys, letter in letters[:reads.RETRY_ALL_MAX]:
            try:
                dead_letters.retry(client, keys, letter, ttl)
                done += 1
            except ValueError as exc:
                failed.append(str(exc).splitlines()[0])
        return done, failed

    done, failed = await run_in_threadpool(retry)
    return _back(request, "/dead", flash=f"queued again: {done}" if done else "",
                 error="; ".join(failed[:3]) + (f" (and {len(failed) - 3} more)"
                                               if len(failed) > 3 else ""))


async def _purge(board: Dashboard, request: Request) -> Response:
    form = await request.form()
    code = str(form.get("code", ""))
    if form.get("confirm") != "purge":
        return _back(request, "/dead", error="not purged: type purge to confirm")
    if not _CODE.fullmatch(code):
        return _back(request, "/dead", error="not a reason code")
    chosen = await run_in_threadpool(lambda: [
        letter for keys in board.views()
        for letter in dead_letters.purge(board.client, keys, dead_letters.MAX_SCAN, code or None)])
    return _back(request, "/dead", flash=f"purged {len(chosen)} dead letter(s)")


# ---------------------------------------------------------------- login


async def _login(board: Dashboard, request: Request) -> Response:
    if board.access.open:
        return RedirectResponse(_base(request) + "/", 303)
    if request.method == "GET":
        return render(board, request, "login.html", page="login")
    form = await request.form()
    role = board.access.role_of_key(str(form.get("key", ""))[:4096])
    if role is None:
        return render(board, request, "login.html", 401, page="login",
                      message="that key is not one of this dashboard's")
    response = RedirectResponse(_base(request) + "/", 303)
    response.set_cookie(COOKIE, board.access.session(role), max_age=SESSION_S,
                        path=_base(request) + "/", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
    return response


async def _logout(board: Dashboard, request: Request) -> Response:
    response = RedirectResponse(_base(request) + "/login", 303)
    response.delete_cookie(COOKIE, path=_base(request) + "/")
    return response
