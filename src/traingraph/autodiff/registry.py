"""The one table of gradient rules, keyed by (domain, op_type, since-opset).

A rule is a function ``rule(ctx, grads) -> grads_in``: ``grads`` holds the gradient of each node
output (None where no gradient flows into it) and the rule returns one gradient per node input
(None for inputs that carry no gradient). ``ctx`` is a
:class:`~traingraph.autodiff.context.GradContext`.

Example:
    >>> @register_gradient("Neg")
    ... def neg(ctx, grads):
    ...     return [ctx.b.Neg(grads[0])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

    from traingraph.autodiff.context import GradContext

Rule = Callable[["GradContext", "Sequence[ir.Value | None]"], "Sequence[ir.Value | None]"]

_RULES: dict[tuple[str, str], list[tuple[int, Rule]]] = {}


def register_gradient(op_type: str, domain: str = "", since: int = 1) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the gradient of ``domain::op_type`` for opsets ``>= since``.

    A later registration for the same key and ``since`` replaces the earlier one, so users can
    override a built-in rule.
    """

    def decorator(rule: Rule) -> Rule:
        versions = _RULES.setdefault((domain, op_type), [])
        versions[:] = [(s, r) for s, r in versions if s != since]
        versions.append((since, rule))
        versions.sort(key=lambda item: item[0])
        return rule

    return decorator


def get_rule(domain: str, op_type: str, opset: int) -> Rule | None:
    """The rule for ``domain::op_type`` at ``opset``, or None when there is none."""
    _load_builtin_rules()
    versions = _RULES.get(("" if domain == "ai.onnx" else domain, op_type), [])
    chosen = None
    for since, rule in versions:
        if since <= opset:
            chosen = rule
    return chosen


def supported_ops() -> tuple[str, ...]:
    """Names of all ops that have a gradient rule (domain-qualified outside the default domain)."""
    _load_builtin_rules()
    return tuple(sorted(op if not dom else f"{dom}::{op}" for dom, op in _RULES))


_loaded = False


def _load_builtin_rules() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from traingraph.autodiff import rules

    rules.load_all()
