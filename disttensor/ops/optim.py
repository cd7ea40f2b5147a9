"""Fused optimizer updates (Paddle's ``adam_`` / ``momentum_`` / ``sgd_`` kernels): one op per
parameter and step. Each declares the tensors it updates in place as ``mutates`` pairs — the
parameter, its moments or velocity, Adam's beta powers — so every output *is* the input tensor
(same holder, same version counter, bumped). The learning rate arrives as a 0-d tensor (a
``host_scalar`` read when the op runs) and the beta powers are state tensors updated by the
kernel, so a captured step replays every later step correctly. Rule: ``elementwise`` (the
parameter, gradient and states share one layout; scalars broadcast)."""
from __future__ import annotations

from ..schema import register, same_dtype
from . import fast, gpu_fused


def _scalar(a) -> float:
    """A one-element array as a Python float (keeps the update in the parameter's dtype)."""
    return float(a.item())


def _adam_elementwise(xp, param, grad, moment1, moment2, beta1, beta2, eps, l2, decay, step):
    """Adam's elementwise update in place: ``g = grad + l2 * param``, ``param *= decay``,
    ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``, ``param -= step * m / (sqrt(v) + eps)``."""
    g = grad + l2 * param if l2 else grad
    tmp = xp.empty_like(moment2)  # the one temporary, reused by every pass below
    if decay != 1.0:
        param *= decay
    moment1 *= beta1
    moment1 += xp.multiply(g, 1.0 - beta1, out=tmp)
    moment2 *= beta2
    xp.multiply(g, g, out=tmp)
    tmp *= 1.0 - beta2
    moment2 += tmp
    xp.sqrt(moment2, out=tmp)
    tmp += eps
    xp.divide(moment1, tmp, out=tmp)
    tmp *= step
    param -= tmp


_adam_pass = fast.adam(gpu_fused.adam(_adam_elementwise))


def _adam_kernel(xp, param, grad, moment1, moment2, beta1_pow, beta2_pow, lr, beta1, beta2,
                 epsilon, l2, weight_decay, lr_scale):
    """One Adam(W) step in place. With ``t`` the step (the beta powers become ``b**t``) and
    ``lr = lr * lr_scale``: ``param *= 1 - lr * weight_decay`` (AdamW's decoupled decay),
    ``g = grad + l2 * param`` (Adam's L2 term), ``m = b1*m + (1-b1)*g``,
    ``v = b2*v + (1-b2)*g*g``, ``param -= lr / (1 - b1**t) * m / (sqrt(v / (1 - b2**t)) + eps)``."""
    beta1_pow *= beta1
    beta2_pow *= beta2
    lr_v = _scalar(lr) * lr_scale
    # lr_t * m / (sqrt(v) * c2 + eps) == (lr_t / c2) * m / (sqrt(v) + eps / c2)
    c2 = 1.0 / (1.0 - _scalar(beta2_pow)) ** 0.5
    step = lr_v / (1.0 - _scalar(beta1_pow)) / c2
    _adam_pass(xp, param, grad, moment1, moment2, beta1, beta2, epsilon / c2, l2,
               1.0 - lr_v * weight_decay, step)
    return param, moment1, moment2, beta1_pow, beta2_pow


def _momentum_kernel(xp, param, grad, velocity, lr, mu, use_nesterov, l2, lr_scale):
    """One SGD-with-momentum step in place: ``g = grad + l2 * param``, ``v = mu * v + g``,
    ``param -= lr * v`` (Nesterov: ``param -= lr * (g + mu * v)``)."""
    lr_v = _scalar(lr) * lr_scale
    g = grad + l2 * param if l2 else grad
    velocity *= mu
    velocity += g
    param -= lr_v * (g + mu * velocity if use_nesterov else velocity)
    return param, velocity


def _sgd_kernel(xp, param, grad, lr, l2, lr_scale):
    """One plain SGD step in place: ``param -= lr * (grad + l2 * param)``."""
    param -= _scalar(lr) * lr_scale * (grad + l2 * param if l2 else grad)
    return param


register("adam_update", _adam_kernel, rule="optimizer_update", n_out=5,
         mutates=((0, 0), (2, 1), (3, 2), (4, 3), (5, 4)), dtype=lambda d, a: (
             d[0], d[2], d[3], d[4], d[5]),
         rule_attrs={"num_outputs": 5, "tensor_inputs": 4, "tensor_outputs": 3})
register("momentum_update", _momentum_kernel, rule="optimizer_update", n_out=2,
         mutates=((0, 0), (2, 1)), dtype=lambda d, a: (d[0], d[2]),
         rule_attrs={"num_outputs": 2, "tensor_inputs": 3, "tensor_outputs": 2})
register("sgd_update", _sgd_kernel, rule="optimizer_update", mutates=((0, 0),),
         dtype=same_dtype(0), rule_attrs={"num_outputs": 1, "tensor_inputs": 2,
                                           "tensor_outputs": 1})
