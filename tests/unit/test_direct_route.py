"""``app.routers.direct``: a DirectRoute takes a bare ``Request`` endpoint and refuses the rest."""

from __future__ import annotations

from typing import Annotated

import pytest
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from app.routers import predict
from app.routers.direct import DirectRoute


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
