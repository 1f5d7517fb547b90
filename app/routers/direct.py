"""``DirectRoute``: an ``APIRoute`` that hands its endpoint the bare ``Request``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class DirectRoute(APIRoute):
    """A route whose endpoint is called with the bare ``Request`` and reads its body and
    query itself (``app.routers.uploads``). FastAPI still documents it (``openapi_extra``)
    but resolves no parameters or dependencies per request, a noticeable share of the event
    loop's time under load.

    As nothing is resolved, construction raises ``TypeError`` for an endpoint with any
    parameter but one annotated ``Request`` (read with ``inspect.signature``, the ``Request``
    one picked by FastAPI's ``dependant.request_param_name``) and for dependencies on the
    route or its router (``self.dependencies``)::

        router = APIRouter(prefix="/predict", route_class=DirectRoute)

        @router.post("/tag", openapi_extra=...)
        async def tag(request: Request) -> JSONResponse: ...
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
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
        if self.dependencies:
            names = (
                getattr(d.dependency, "__name__", repr(d.dependency)) for d in self.dependencies
            )
            problems.append(f"dependencies {', '.join(names)}")
        if problems:
            name = getattr(endpoint, "__qualname__", repr(endpoint))
            raise TypeError(
                f"DirectRoute {path!r}: endpoint {name} has {'; '.join(problems)}; a DirectRoute "
                "resolves nothing, so its endpoint takes exactly one parameter, annotated "
                "Request, and the route has no dependencies"
            )

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint
