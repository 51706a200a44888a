"""What the bad-input tests share: a small layer's NVFP4 weights, logits without gradients, a
prompt and one expert's checkpoint prefix."""

import torch

import fp4moe_ops

E3 = "model.layers.1.mlp.experts.3"


def layer(e=4, h=64, i=32, scales=False):
    w = fp4moe_ops.quantize_moe_weights(torch.randn(e, 2 * i, h) / h**0.5, torch.randn(e, h, i) / i**0.5)
    if scales:
        w.gate_up_input_scale, w.down_input_scale = torch.rand(e) * 1e-3 + 1e-4, torch.rand(e) * 1e-3 + 1e-4
    return w


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.arange(1, 10).reshape(1, 9)


def snapshot(module):
    """Every tensor a module holds, non-persistent buffers included (a fused shared expert's file scalars)."""
    return {k: v.clone() for k, v in [*module.named_buffers(), *module.named_parameters()]}


def unchanged(module, before):
    now = dict([*module.named_buffers(), *module.named_parameters()])
    return now.keys() == before.keys() and all(now[k].dtype == v.dtype and torch.equal(now[k], v)
                                               for k, v in before.items())
