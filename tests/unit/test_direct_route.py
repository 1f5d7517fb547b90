"""``app.routers.direct``: a DirectRoute takes a bare ``Request`` endpoint and refuses the rest;
a DirectApp calls its fixed-path DirectRoutes straight from the server."""

from __future__ import annotations

from typing import Annotated, Any

import httpx
import pytest
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from app.errors import InvalidParameter, ServerError
from app.routers import predict
from app.routers.direct import DirectApp, DirectRoute


def api_key() -> str:
    return "secret"


def test_the_prediction_endpoints_are_accepted() -> None:
    router = APIRouter(route_class=DirectRoute)
    router.add_api_route("/embedding", predict.embedding, methods=["POST"])
    router.add_api_route("/tag", predict.tag, methods=["POST"])
    assert [type(r) for r in router.routes] == [DirectRoute, DirectRoute]
    assert all(type(r) is DirectRoute for r in predict.router.routes)


def test_an_extra_query_parameter_is_refused() -> None:
    async def top(request: Request, k: int = 5) -> JSONResponse:
        return JSONResponse(k)

    with pytest.raises(TypeError, match=r"endpoint .*top has parameters k\b"):
        APIRouter(route_class=DirectRoute).add_api_route("/top", top)


def test_a_depends_parameter_is_refused() -> None:
    async def guarded(request: Request, key: Annotated[str, Depends(api_key)]) -> JSONResponse:
        return JSONResponse(key)

    with pytest.raises(TypeError, match=r"endpoint .*guarded has parameters key\b"):
        APIRouter(route_class=DirectRoute).add_api_route("/guarded", guarded)


@pytest.mark.parametrize("on", ["router", "route"])
def test_a_router_or_route_dependency_is_refused(on: str) -> None:
    async def plain(request: Request) -> JSONResponse:
        return JSONResponse(None)

    dependencies = [Depends(api_key)]
    router = APIRouter(route_class=DirectRoute, dependencies=dependencies if on == "router" else [])
    with pytest.raises(TypeError, match=r"endpoint .*plain has dependencies api_key\b"):
        router.add_api_route("/plain", plain, dependencies=dependencies if on == "route" else [])


def test_an_endpoint_without_a_request_is_refused() -> None:
    async def bare(body: bytes) -> JSONResponse:
        return JSONResponse(None)

    with pytest.raises(TypeError, match="no parameter annotated Request; parameters body"):
        APIRouter(route_class=DirectRoute).add_api_route("/bare", bare)


def test_a_guard_of_the_request_alone_runs_before_the_endpoint() -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    seen: list[str] = []

    async def guard(request: Request) -> None:
        seen.append("guard")
        if request.headers.get("x-let-in") != "yes":
            raise PermissionError("refused")

    async def plain(request: Request) -> JSONResponse:
        seen.append("endpoint")
        return JSONResponse("ok")

    router = APIRouter(route_class=DirectRoute, dependencies=[Depends(guard)])
    router.add_api_route("/plain", plain, methods=["GET"])
    app = FastAPI()
    app.include_router(router)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/plain", headers={"x-let-in": "yes"}).json() == "ok"
        assert client.get("/plain").status_code == 500
    assert seen == ["guard", "endpoint", "guard"]


class Seen:
    """Pure ASGI middleware that logs its name and each path it sees."""

    def __init__(self, app: Any, name: str, log: list[str]) -> None:
        self.app = app
        self.name = name
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.log.append(f"{self.name} {scope['path']}")
        await self.app(scope, receive, send)


def direct_app() -> tuple[DirectApp, list[str]]:
    """An app with direct routes and two middlewares of its own; what they saw. Each answer
    says whether Starlette's router took the request (it marks the scope)."""
    app = DirectApp()
    router = APIRouter(prefix="/p", route_class=DirectRoute)

    async def echo(request: Request) -> JSONResponse:
        if request.query_params.get("fail") == "client":
            raise InvalidParameter("k must be between 1 and 5")
        if request.query_params.get("fail") == "bug":
            raise ZeroDivisionError("a bug")
        if request.query_params.get("fail") == "http":
            raise HTTPException(413, "too big")
        body = len(await request.body())
        routed = "router" in request.scope
        return JSONResponse({"body": body, "route": request.scope["route"].path, "routed": routed})

    async def named(request: Request) -> JSONResponse:
        return JSONResponse({**request.path_params, "routed": "router" in request.scope})

    router.add_api_route("/echo", echo, methods=["POST"])
    router.add_api_route("/items/{name}", named, methods=["POST"])
    app.include_router(router)

    @app.exception_handler(ServerError)
    async def domain(request: Request, exc: ServerError) -> JSONResponse:
        return JSONResponse({"error": exc.code}, 400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": "internal"}, 500)

    @app.exception_handler(413)
    async def too_large(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": "too large"}, 413)

    log: list[str] = []
    app.add_middleware(Seen, name="inner", log=log)
    app.add_middleware(Seen, name="outer", log=log)
    app.route_directly(router.routes)
    return app, log


async def test_a_direct_route_skips_the_stack_but_not_the_apps_middleware() -> None:
    app, log = direct_app()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        ok = await client.post("/p/echo", content=b"12345")
        refused = await client.post("/p/echo?fail=client")
        bug = await client.post("/p/echo?fail=bug")
        http = await client.post("/p/echo?fail=http")
        wrong_method = await client.get("/p/echo")
        with_param = await client.post("/p/items/cat")
    assert ok.json() == {"body": 5, "route": "/p/echo", "routed": False}
    assert (refused.status_code, refused.json()) == (400, {"error": "invalid_parameter"})
    assert (bug.status_code, bug.json()) == (500, {"error": "internal"})
    assert (http.status_code, http.json()) == (413, {"error": "too large"})  # by its status
    assert wrong_method.status_code == 405  # the usual way, with its 405
    # A path with parameters: direct too, its parameters matched as the router would.
    assert with_param.json() == {"name": "cat", "routed": False}
    # Every request, direct or not, went through the app's middleware, outermost first.
    paths = ["/p/echo"] * 5 + ["/p/items/cat"]
    assert log == [f"{layer} {path}" for path in paths for layer in ("outer", "inner")]


async def test_a_direct_route_is_found_below_the_root_path() -> None:
    app, log = direct_app()
    transport = httpx.ASGITransport(app=app, root_path="/api")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        ok = await client.post("/api/p/echo", content=b"12")
    assert ok.json() == {"body": 2, "route": "/p/echo", "routed": False}
    assert log == ["outer /api/p/echo", "inner /api/p/echo"]
