"""Pure PromQL helpers: parse an expression and list the metric names it references.

Dashboard expressions contain Grafana template variables (``$__rate_interval``, ``$model``) that
are not PromQL; :func:`expand_template_vars` replaces them with concrete values first.
"""

from __future__ import annotations

import re
from typing import Any

import promql_parser

from kvdiag.dashboards.vllm_metrics import vllm_exposed_names
from kvdiag.schema.errors import KVDiagError
from kvdiag.schema.metrics import all_exposed_names

# Grafana's interval variables -> a duration; every other ``$var`` / ``${var}`` -> a match-all regex.
_INTERVAL_VARS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class PromQLError(KVDiagError, ValueError):
    """An expression does not parse or names a metric outside the catalog and vLLM's list."""


def expand_template_vars(expr: str, intervals: dict[str, str] | None = None, default: str = ".*") -> str:
    """Replace Grafana template variables so the expression is plain PromQL."""
    durations = {**_INTERVAL_VARS, **(intervals or {})}

    def sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return durations.get(name, default)

    return _VAR.sub(sub, expr)


def parse(expr: str) -> Any:
    """Parse ``expr`` (after template expansion); raise PromQLError quoting the expression."""
    try:
        return promql_parser.parse(expand_template_vars(expr))
    except ValueError as exc:
        raise PromQLError(f"PromQL does not parse: {exc}: {expr!r}") from None


def metric_names(expr: str) -> frozenset[str]:
    """Every metric name a (possibly templated) PromQL expression selects."""
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            if name is None:
                name = next((m.value for m in node.matchers.matchers
                             if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal), None)
            if name is None:
                raise PromQLError(f"selector without a literal metric name in {expr!r}")
            names.add(name)
        return True

    promql_parser.walk(parse(expr), visit)
    return frozenset(names)


def known_metric_names() -> frozenset[str]:
    """Names an expression may use: the kvdiag catalog's series and vLLM's documented metrics."""
    return all_exposed_names() | vllm_exposed_names()


def unknown_metric_names(expr: str) -> frozenset[str]:
    """Names in ``expr`` that are neither catalog nor documented vLLM series."""
    return metric_names(expr) - known_metric_names()


_COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
_RATE_FUNCTIONS = frozenset({"rate", "irate", "increase"})


def bare_counter_selectors(expr: str) -> frozenset[str]:
    """Counter-like series (``_total``, ``_bucket``, ``_sum``, ``_count``) used outside rate/irate/increase.

    The dashboard-linter rule ``target-counter-agg-rule``: a raw counter value is meaningless.
    """
    stack: list[str] = []
    bare: set[str] = set()

    def pre(node: Any) -> bool:
        if isinstance(node, promql_parser.Call):
            stack.append(node.func.name)
        elif isinstance(node, promql_parser.VectorSelector):
            name = node.name or ""
            if name.endswith(_COUNTER_SUFFIXES) and not (stack and stack[-1] in _RATE_FUNCTIONS):
                bare.add(name)
        return True

    def post(node: Any) -> bool:
        if isinstance(node, promql_parser.Call):
            stack.pop()
        return True

    promql_parser.walk(parse(expr), pre, post)
    return frozenset(bare)
