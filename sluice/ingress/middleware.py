"""--middleware: operators' ASGI middleware around the ingress app. Each is `module:factory` (an importable
module) or `path/to/file.py:factory`; the factory takes the ASGI app and returns the app that wraps it. The
first given is the outermost: it sees each request first and its response last. A middleware sees every
scope (lifespan too) and must pass on what it does not handle; what it puts in a request's scope (its
"state" included) reaches the app as it left it. deploy/middleware_example.py is an example."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Callable

App = Callable[..., Any]  # an ASGI app: (scope, receive, send) -> awaitable


def load(spec: str) -> Callable[[App], App]:
    """The factory `spec` names (ValueError, saying why, when it names none)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--middleware {spec!r}: give module:factory or path/to/file.py:factory")
    try:
        module = _from_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise ValueError(f"--middleware {spec!r}: cannot load {where}: {e}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"--middleware {spec!r}: {where} has no callable {name!r}")
    return factory


def _from_file(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"sluice_middleware.{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checked(spec: str) -> str:
    """`spec` once it loads (at startup, so that a typo fails the start rather than each ingress worker), with
    a file's path made absolute."""
    load(spec)
    where, _, name = spec.rpartition(":")
    return f"{Path(where).resolve()}:{name}" if where.endswith(".py") else spec


def wrapped(app: App, specs: list[str]) -> App:
    """`app` inside the middleware `specs` name, the first the outermost."""
    for spec in reversed(specs):
        app = load(spec)(app)
    return app
