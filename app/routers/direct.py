"""``DirectRoute``: an ``APIRoute`` that hands its endpoint the bare ``Request``; and
``DirectApp``, a FastAPI app that calls those routes straight from the server."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.dependencies.utils import get_dependant
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send


class DirectRoute(APIRoute):
    """A route whose endpoint is called with the bare ``Request`` and reads its body and
    query itself (``app.routers.uploads``). FastAPI still documents it (``openapi_extra``)
    but resolves no parameters or dependencies per request, a noticeable share of the event
    loop's time under load.

    As nothing is resolved, construction raises ``TypeError`` for an endpoint with any
    parameter but one annotated ``Request`` (read with ``inspect.signature``, the ``Request``
    one picked by FastAPI's ``dependant.request_param_name``), and for a dependency on the
    route or its router (``self.dependencies``) unless it is a guard: an async callable of
    the ``Request`` alone (such as ``app.dependencies.ApiKey``), which the route awaits
    before its endpoint, in order, and whose result it drops::

        router = APIRouter(prefix="/predict", route_class=DirectRoute,
                           dependencies=REQUIRES_API_KEY)

        @router.post("/tag", openapi_extra=...)
        async def tag(request: Request) -> JSONResponse: ...
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        # Known before the base class builds the handler (it calls get_route_handler).
        self._guards: list[Callable[[Request], Awaitable[Any]]] = []
        refused = []
        for depends in kwargs.get("dependencies") or ():
            call = depends.dependency
            if call is not None and _is_guard(path, call):
                self._guards.append(call)
            else:
                refused.append(getattr(call, "__name__", repr(call)))
        super().__init__(path, endpoint, **kwargs)
        # Dependencies given to include_router() are not seen here: FastAPI 0.165 applies
        # them to a copy of the route that it builds lazily, when requests come. Pass none.
        problems: list[str] = []
        request_param = self.dependant.request_param_name
        if request_param is None:
            problems.append("no parameter annotated Request")
        others = [p for p in inspect.signature(endpoint).parameters if p != request_param]
        if others:
            problems.append(f"parameters {', '.join(others)}")
        if refused:
            problems.append(f"dependencies {', '.join(refused)}")
        if problems:
            name = getattr(endpoint, "__qualname__", repr(endpoint))
            raise TypeError(
                f"DirectRoute {path!r}: endpoint {name} has {'; '.join(problems)}; a DirectRoute "
                "resolves nothing, so its endpoint takes exactly one parameter, annotated "
                "Request, and its only dependencies are async guards of the Request alone"
            )

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        if not self._guards:
            return endpoint
        guards = tuple(self._guards)

        async def guarded(request: Request) -> Response:
            for guard in guards:
                await guard(request)
            return await endpoint(request)

        return guarded


def _is_guard(path: str, call: Callable[..., Any]) -> bool:
    """An async callable whose one parameter is the ``Request`` (or its base class,
    ``HTTPConnection``), as FastAPI reads it."""
    method = call if inspect.isfunction(call) else type(call).__call__
    if not inspect.iscoroutinefunction(method):
        return False
    dependant = get_dependant(path=path, call=call)
    resolved = (
        dependant.path_params, dependant.query_params, dependant.header_params,
        dependant.cookie_params, dependant.body_params, dependant.dependencies,
    )  # fmt: skip
    takes_request = dependant.request_param_name or dependant.http_connection_param_name
    return takes_request is not None and not any(resolved)


class DirectApp(FastAPI):
    """A FastAPI app whose ``DirectRoute``s (given to ``route_directly``) are called
    straight from the ASGI server: past Starlette's router,
    which tries every route in turn, and FastAPI's own middleware stack (error, telemetry,
    body-size and exception middlewares, the exit stack, the included-router copy), inside
    the app's own middleware only (``add_middleware``: here the log line and the body limit),
    and answered on error by the app's exception handlers, as the stack would. Every other
    request, and any other method on those paths, takes the usual way.

    Under load this cuts most of what the event loop spent between the server and the
    endpoint (docs/performance.md); the OpenAPI docs still describe the routes, which
    FastAPI holds as usual."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct_routes: list[DirectRoute] = []
        # Built at the first request: by method and path, each route and its wrapped endpoint.
        self._direct: dict[tuple[str, str], tuple[DirectRoute, ASGIApp]] | None = None
        self._matched: list[tuple[DirectRoute, ASGIApp]] = []  # those with path parameters

    def route_directly(self, routes: Iterable[Any]) -> None:
        """Serve each ``DirectRoute`` of ``routes`` directly. One with path parameters is
        matched before every other route, so its path must overlap none of theirs."""
        self._direct_routes += [route for route in routes if isinstance(route, DirectRoute)]

    def _build_direct(self) -> dict[tuple[str, str], tuple[DirectRoute, ASGIApp]]:
        """Each direct route's endpoint wrapped in the app's own middleware, outermost first
        as ``add_middleware`` left it (which Starlette forbids once requests come): by
        method and path, or (with path parameters) in ``_matched``."""
        direct: dict[tuple[str, str], tuple[DirectRoute, ASGIApp]] = {}
        for route in self._direct_routes:
            endpoint: ASGIApp = _DirectEndpoint(self, route)
            for cls, args, kwargs in reversed(self.user_middleware):
                endpoint = cls(endpoint, *args, **kwargs)
            if route.param_convertors:
                self._matched.append((route, endpoint))
                continue
            for method in route.methods or ():
                direct[(method, route.path)] = (route, endpoint)
        return direct

    def _endpoint(self, scope: Scope) -> tuple[DirectRoute, ASGIApp] | None:
        assert self._direct is not None
        found = self._direct.get((scope["method"], _route_path(scope)))
        if found is not None or not self._matched:
            return found
        for route, matched in self._matched:
            match, child = route.matches(scope)
            if match is Match.FULL:
                scope["path_params"] = child["path_params"]
                return route, matched
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self._direct is None:
                self._direct = self._build_direct()
            found = self._endpoint(scope)
            if found is not None:
                # Known before the app's middleware runs: a body refused by its length is
                # counted and logged under its route, as one refused while it streams.
                scope["app"], scope["route"] = self, found[0]
                await found[1](scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The request's path below the app's root path (``--root-path``), as routes see it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


class _DirectEndpoint:
    """One ``DirectRoute`` as an ASGI app: its handler's response, or the app's exception
    handler's for what it raised (looked up along the exception's class hierarchy, as
    Starlette does; ``Exception``'s answers the unexpected with a 500)."""

    def __init__(self, app: FastAPI, route: DirectRoute) -> None:
        self.app = app
        self.route = route
        self.handler = route.get_route_handler()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self.route
        scope["endpoint"] = self.route.endpoint
        scope.setdefault("path_params", {})
        request = Request(scope, receive, send)
        try:
            response = await self.handler(request)
        except Exception as exc:
            response = await self._answer(request, exc)
        await response(scope, receive, send)

    async def _answer(self, request: Request, exc: Exception) -> Response:
        handlers = self.app.exception_handlers
        keys: list[Any] = list(type(exc).__mro__)
        if isinstance(exc, HTTPException):  # a handler for its status comes first
            keys.insert(0, exc.status_code)
        for key in keys:
            handler = handlers.get(key)
            if handler is not None:
                answer = handler(request, exc)
                response: Response = await answer if inspect.isawaitable(answer) else answer
                return response
        raise exc
