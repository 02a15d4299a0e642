"""transformers' environment for chat templates, as its ``render_jinja_template`` builds it: jinja2's immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the loop controls, the ``tojson`` filter (``json.dumps``,
no HTML escaping), the globals ``raise_exception`` and ``strftime_now``, transformers 5.x's ``dict`` and
``namespace``, and the ``{% generation %}...{% endgeneration %}`` tag, whose spans are recorded while
:meth:`meshkit.data.chat_template.ChatTemplate.render_tagged` renders.

Imported when a template is first compiled (``chat_template._environment``): jinja2 loads only then.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "meshkit_generation", default=None
)
"""While a tagged render runs: the blocks rendered so far and the generation spans found."""


class Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: renders its body, and records its characters
    while a tagged render runs (``TRACKING``)."""

    tags = frozenset({"generation"})

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text = caller()
        tracking = TRACKING.get()
        if tracking is not None:
            blocks, spans = tracking
            start = sum(map(len, blocks))
            spans.append((start, start + len(text)))
        return text


class TemplateDict:
    """transformers 5.x's ``dict``: a plain dict, no attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """transformers 5.x's ``namespace``: no underscore-prefixed names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment as transformers builds it (the module docstring)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env
