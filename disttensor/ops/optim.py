"""Fused optimizer updates (like Paddle's ``adam_`` / ``sgd_`` kernels): one op per parameter
and step instead of a dozen elementwise ones. Each writes the parameter (and its moments) in
place (``mutates``); the step-dependent scalars arrive as 0-d tensors, so the distributed
dispatcher's cached decision is reused across steps. Rule: ``elementwise`` (the parameter,
gradient and moments share one layout)."""
from __future__ import annotations

from .registry import register


@register("adam_update", rule="elementwise", mutates=(0, 2, 3))
def _adam_kernel(xp, param, grad, moment1, moment2, lr_t, c2, decay, beta1, beta2, epsilon, l2):
    """One Adam(W) step in place: ``param *= decay`` (AdamW's decoupled weight decay),
    ``g = grad + l2 * param`` (Adam's L2 term), ``m = b1*m + (1-b1)*g``,
    ``v = b2*v + (1-b2)*g*g``, ``param -= lr_t * m / (sqrt(v) * c2 + epsilon)`` where
    ``lr_t = lr / (1 - b1**t)`` and ``c2 = 1 / sqrt(1 - b2**t)``."""
    g = grad + l2 * param if l2 else grad
    param *= decay
    moment1 *= beta1
    moment1 += (1.0 - beta1) * g
    moment2 *= beta2
    moment2 += (1.0 - beta2) * (g * g)
    param -= lr_t * moment1 / (xp.sqrt(moment2) * c2 + epsilon)
    return param


@register("sgd_update", rule="elementwise", mutates=(0,))
def _sgd_kernel(xp, param, grad, lr, l2):
    """One plain SGD step in place: ``param -= lr * (grad + l2 * param)``."""
    param -= lr * (grad + l2 * param if l2 else grad)
    return param
