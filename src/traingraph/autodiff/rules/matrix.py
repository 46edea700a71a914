r"""Gradients of the matrix products: MatMul, Gemm and Einsum.

For ``Y = A @ B`` with output gradient ``G`` the input gradients are

.. math::

    \bar A = G B^T, \qquad \bar B = A^T G,

summed over the batch dimensions that broadcasting added to each operand. The rules emit them
on the fastest kernels the shapes allow: ``Gemm`` with its ``transA`` / ``transB`` flags instead
of ``Transpose`` nodes for 2-D products, and a single ``[B*T, K]^T @ [B*T, N]`` ``Gemm`` for
the weight gradient of a batched activation times a 2-D weight.

The gradient of an Einsum operand is itself an Einsum of the output gradient with the other
operands, written back to that operand's subscripts.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx_ir as ir

from traingraph.autodiff.context import GradContext, unbroadcast
from traingraph.autodiff.registry import register_gradient
from traingraph.ir.builder import OpBuilder, rank

Grads = Sequence[ir.Value | None]
Dim = int | ir.SymbolicDim


def _swap_last(b: OpBuilder, x: ir.Value, r: int) -> ir.Value:
    """``x`` with its last two axes swapped (``x`` has rank ``r >= 2``)."""
    return b.Transpose(x, perm=[*range(r - 2), r - 1, r - 2])


def _gemm(
    b: OpBuilder, x: ir.Value, y: ir.Value, trans_x: bool, trans_y: bool, alpha: float = 1.0
) -> ir.Value:
    """``alpha * op(x) @ op(y)`` as one ``Gemm``; ``op`` transposes where asked."""
    attrs: dict[str, float | int] = {}
    if trans_x:
        attrs["transA"] = 1
    if trans_y:
        attrs["transB"] = 1
    if alpha != 1.0:
        attrs["alpha"] = alpha
    return b.Gemm(x, y, **attrs)


def _flatten_rows(b: OpBuilder, x: ir.Value, r: int) -> ir.Value:
    """``x`` viewed as a matrix ``[prod(leading dims), last dim]``."""
    return x if r == 2 else b.Flatten(x, axis=r - 1)


def _batch_dims_are_one(x: ir.Value, r: int) -> bool:
    """Whether every batch dimension of ``x`` (rank ``r``) is statically 1 (true for a matrix)."""
    assert x.shape is not None
    return all(d == 1 for d in x.shape.dims[: r - 2])


def _record_shape(value: ir.Value, y: ir.Value, tail: Sequence[Dim]) -> None:
    """Record ``value``'s shape as ``y``'s batch dims followed by ``tail`` when ``y``'s is known.

    ``ctx.unbroadcast`` reduces the batch axes with static ``ReduceSum`` nodes when it knows both
    shapes, and falls back to a run-time reduction otherwise.
    """
    if y.shape is not None and y.type is not None:
        value.shape = ir.Shape([*y.shape.dims[:-2], *tail])
        value.type = y.type


@register_gradient("MatMul")
def matmul(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``Y = A @ B`` with numpy ``matmul`` semantics.

    A 1-D ``A`` is a row vector ``[1, K]`` and a 1-D ``B`` a column vector ``[K, 1]`` whose
    inserted axis is removed from ``Y``. For ``A: [..., M, K]`` and ``B: [..., K, N]``:
    ``dA = unbroadcast(G @ B^T)``, ``dB = unbroadcast(A^T @ G)``.
    """
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    a, w = ctx.x(0), ctx.x(1)
    ra, rb = rank(a), rank(w)
    if ra is None or rb is None:
        ctx.unsupported(
            f"the rank of input {'A' if ra is None else 'B'} is unknown; the gradient needs"
            " static ranks (run onnx.shape_inference.infer_shapes on the model first)"
        )
    if ra == 1 and rb == 1:
        # y = sum_k a[k] b[k]
        return [
            b.Mul(g, w) if ctx.need(0) else None,
            b.Mul(g, a) if ctx.need(1) else None,
        ]
    if ra == 1:
        return [
            _vector_matrix_grad_a(ctx, g, w, rb) if ctx.need(0) else None,
            # dB[..., k, n] = a[k] g[..., n]
            b.Mul(b.unsqueeze(a, [-1]), b.unsqueeze(g, [-2])) if ctx.need(1) else None,
        ]
    if rb == 1:
        # y[..., m] = sum_k A[..., m, k] b[k]
        grad_b = None
        if ctx.need(1):
            # dB[k] = sum_{..., m} A[..., m, k] g[..., m]: one vector-matrix product.
            flat_g = g if ra == 2 else b.Reshape(g, b.ints([-1]))
            grad_b = b.MatMul(flat_g, _flatten_rows(b, a, ra))
        return [b.Mul(b.unsqueeze(g, [-1]), w) if ctx.need(0) else None, grad_b]
    return [
        _matrix_grad_a(ctx, g, a, w, ra, rb) if ctx.need(0) else None,
        _matrix_grad_b(ctx, g, a, w, ra, rb) if ctx.need(1) else None,
    ]


def _vector_matrix_grad_a(ctx: GradContext, g: ir.Value, w: ir.Value, rb: int) -> ir.Value:
    """``dA[k] = sum_{..., n} B[..., k, n] g[..., n]`` for a 1-D ``A``."""
    b = ctx.b
    if rb == 2:
        return b.MatMul(w, g)
    per_batch = b.MatMul(w, b.unsqueeze(g, [-1]))
    return b.sum(per_batch, [*range(rb - 2), rb - 1], keepdims=False)


def _matrix_grad_a(
    ctx: GradContext, g: ir.Value, a: ir.Value, w: ir.Value, ra: int, rb: int
) -> ir.Value:
    """``dA = G @ B^T`` summed over the batch axes broadcast onto ``A``."""
    b = ctx.b
    if ra == 2 and rb == 2:
        return _gemm(b, g, w, False, True)
    grad = b.MatMul(g, _swap_last(b, w, rb))
    if rb <= ra and _batch_dims_are_one(w, rb):
        return grad
    assert a.shape is not None
    _record_shape(grad, ctx.outputs[0], a.shape.dims[-2:])
    return unbroadcast(b, grad, a, grad)


def _matrix_grad_b(
    ctx: GradContext, g: ir.Value, a: ir.Value, w: ir.Value, ra: int, rb: int
) -> ir.Value:
    """``dB = A^T @ G`` summed over the batch axes broadcast onto ``B``.

    When ``B`` has no batch (its batch dims are all 1), the sum over the batch of ``A^T G`` is
    one matrix product of the flattened rows, ``[prod(batch) * M, K]^T @ [prod(batch) * M, N]``.
    """
    b = ctx.b
    rg = max(ra, rb)
    if _batch_dims_are_one(w, rb):
        grad = _gemm(b, _flatten_rows(b, a, ra), _flatten_rows(b, g, rg), True, False)
        return grad if rb == 2 else b.unsqueeze(grad, list(range(rb - 2)))
    grad = b.MatMul(_swap_last(b, a, ra), g)
    if ra <= rb and _batch_dims_are_one(a, ra):
        return grad
    assert w.shape is not None
    _record_shape(grad, ctx.outputs[0], w.shape.dims[-2:])
    return unbroadcast(b, grad, w, grad)


@register_gradient("Gemm")
def gemm(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    """Gradient of ``Y = alpha * A' @ B' + beta * C`` with ``A' = op(A)``, ``B' = op(B)``.

    ``dA' = alpha G B'^T``, ``dB' = alpha A'^T G`` (transposed back where ``transA`` /
    ``transB`` is set, which only swaps the operands and flags of one ``Gemm``) and
    ``dC = beta * unbroadcast(G)``.
    """
    b, g = ctx.b, ctx.grad_or_zeros(grads, 0)
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    trans_a, trans_b = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    a, w = ctx.x(0), ctx.x(1)
    grad_a = grad_b = grad_c = None
    if ctx.need(0):
        grad_a = (
            _gemm(b, w, g, trans_b, True, alpha)
            if trans_a
            else _gemm(b, g, w, False, not trans_b, alpha)
        )
    if ctx.need(1):
        grad_b = (
            _gemm(b, g, a, True, trans_a, alpha)
            if trans_b
            else _gemm(b, a, g, not trans_a, False, alpha)
        )
    if not ctx.has_input(2):
        return [grad_a, grad_b]
    if ctx.need(2):
        c = ctx.x(2)
        grad_c = ctx.unbroadcast(g, c)
        if beta != 1.0:
            grad_c = b.Mul(grad_c, b.scalar(beta, like=c))
    return [grad_a, grad_b, grad_c]


# ------------------------------------------------------------------------------------ Einsum
# Subscripts are handled as strings of labels with the ellipsis "..." written as one ".".


def _einsum_terms(ctx: GradContext) -> tuple[str, list[str], str]:
    """The equation, its input terms and its output term (an implicit output spelled out)."""
    equation = str(ctx.attr("equation", "")).replace(" ", "")
    lhs, arrow, out = equation.replace("...", ".").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ctx.inputs):
        ctx.unsupported(
            f"equation {equation!r} has {len(terms)} operands but the node has"
            f" {len(ctx.inputs)} inputs; give one comma-separated term per input"
        )
    has_ellipsis = any("." in t for t in terms)
    if not arrow:
        labels = [c for t in terms for c in t if c != "."]
        single = sorted(c for c in set(labels) if labels.count(c) == 1)
        out = ("." if has_ellipsis else "") + "".join(single)
    elif has_ellipsis and "." not in out:
        ctx.unsupported(
            f"equation {equation!r} sums over its ellipsis dimensions; write '...' in the"
            " output and reduce those dimensions with ReduceSum instead"
        )
    return equation, terms, out


def _ellipsis_rank(ctx: GradContext, equation: str, term: str, x: ir.Value) -> int:
    """How many dimensions the ellipsis of ``term`` covers in ``x`` (0 without an ellipsis)."""
    if "." not in term:
        return 0
    r = rank(x)
    if r is None:
        ctx.unsupported(
            f"equation {equation!r} has an ellipsis on an operand of unknown rank; run"
            " onnx.shape_inference.infer_shapes on the model first"
        )
    return r - (len(term) - 1)


def _same_dim(d: Dim, e: Dim) -> bool:
    if isinstance(d, int) or isinstance(e, int):
        return d == e
    return d.value is not None and d.value == e.value


@register_gradient("Einsum")
def einsum(ctx: GradContext, grads: Grads) -> list[ir.Value | None]:
    r"""Gradient of ``Y = einsum(equation, X_0, ..., X_{n-1})``.

    .. math::

        \bar X_i = \mathrm{einsum}(\text{out}, \text{term}_{j \ne i}
                     \to \text{term}_i)(G, X_{j \ne i})

    Letters of ``term_i`` found nowhere else were summed out of ``Y``: they are left out of that
    Einsum and restored with ``Expand``. Ellipsis dimensions that ``X_i`` broadcast (size 1, or
    fewer of them) are summed back. Repeated letters within one operand (diagonals) are not
    supported for that operand's gradient.
    """
    g = ctx.grad_or_zeros(grads, 0)
    equation, terms, out = _einsum_terms(ctx)
    ranks = [_ellipsis_rank(ctx, equation, t, ctx.x(j)) for j, t in enumerate(terms)]
    return [
        _einsum_operand_grad(ctx, g, equation, terms, out, ranks, i)
        if ctx.need(i)
        else None
        for i in range(len(terms))
    ]


def _einsum_operand_grad(
    ctx: GradContext,
    g: ir.Value,
    equation: str,
    terms: list[str],
    out: str,
    ranks: list[int],
    i: int,
) -> ir.Value:
    b, x, term = ctx.b, ctx.x(i), terms[i]
    if len(set(term)) != len(term):
        ctx.unsupported(
            f"operand {i} of equation {equation!r} repeats a letter (a diagonal), whose gradient"
            " is not supported; take the diagonal in a separate op"
        )
    others = [t for j, t in enumerate(terms) if j != i]
    available = set(out).union(*others)
    kept = "".join(c for c in term if c in available)
    grad_out = kept if "." in kept or "." not in out else "." + kept
    full = max(ranks)
    grad = b.Einsum(
        g,
        *(ctx.x(j) for j in range(len(terms)) if j != i),
        equation=",".join([out, *others]).replace(".", "...")
        + "->"
        + grad_out.replace(".", "..."),
    )
    if "." in grad_out and full > ranks[i]:
        start = grad_out.index(".")
        grad = b.sum(grad, list(range(start, start + full - ranks[i])), keepdims=False)

    def axis(label_pos: int) -> int:
        before = term[:label_pos]
        return label_pos if "." not in before else label_pos - 1 + ranks[i]

    summed = [axis(p) for p, c in enumerate(term) if c not in available]
    if summed:
        grad = b.Expand(b.unsqueeze(grad, summed), b.shape(x))
    if "." in term:
        grad = _sum_broadcast_ellipsis(ctx, grad, x, terms, ranks, i)
    return grad


def _sum_broadcast_ellipsis(
    ctx: GradContext, grad: ir.Value, x: ir.Value, terms: list[str], ranks: list[int], i: int
) -> ir.Value:
    """Sum ``grad`` over the ellipsis axes that operand ``i`` broadcast (it has size 1 there)."""
    assert x.shape is not None
    start, count = terms[i].index("."), ranks[i]
    static_axes: list[int] = []
    for k in range(count):
        d = x.shape.dims[start + k]
        if isinstance(d, int) and d != 1:
            continue
        from_right = count - k
        partners = [
            ctx.x(j).shape.dims[t.index(".") + ranks[j] - from_right]  # type: ignore[union-attr]
            for j, t in enumerate(terms)
            if j != i and "." in t and ranks[j] >= from_right
        ]
        if all(p == 1 or _same_dim(p, d) for p in partners):
            continue
        if d != 1:
            # A symbolic size that may be 1 at run time: reduce where the run-time size is 1.
            return unbroadcast(ctx.b, grad, x, grad)
        static_axes.append(start + k)
    return ctx.b.sum(grad, static_axes, keepdims=True) if static_axes else grad
