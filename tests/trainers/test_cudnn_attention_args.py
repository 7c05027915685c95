"""The cuDNN packed-attention path (trainers/megatron/layers.py, PACKED_ATTENTION = "cudnn") calls
two private aten ops whose argument order changed between torch releases (torch 2.11's own
varlen_attn passes the backward's in the old order, which a GPU run showed). Its arguments go by
schema name; here they are checked against this torch's schemas, kind by kind, on the CPU."""

import torch

from agentrl.trainers.megatron.layers import cudnn_backward_args, cudnn_forward_args


def _check(op, args: dict) -> None:
    schema = op.default._schema
    names = [a.name for a in schema.arguments]
    assert sorted(args) == sorted(names), (set(names) ^ set(args))
    for a in schema.arguments:
        value, kind = args[a.name], str(a.type)
        if kind.endswith("?") and value is None:
            continue
        if kind.startswith("Tensor"):
            assert isinstance(value, torch.Tensor), (a.name, kind, type(value))
        elif kind.startswith(("SymInt", "int")):
            assert isinstance(value, int) and not isinstance(value, bool), (a.name, kind, value)
        elif kind.startswith("float"):
            assert isinstance(value, float), (a.name, kind, value)
        elif kind.startswith("bool"):
            assert isinstance(value, bool), (a.name, kind, value)


def test_cudnn_attention_arguments_match_this_torch():
    t, h, d = 10, 4, 8
    q, k, v = torch.zeros(t, h, d), torch.zeros(t, 2, d), torch.zeros(t, 2, d)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    _check(torch.ops.aten._cudnn_attention_forward, cudnn_forward_args(q, k, v, cu, 6, 0.125))
    seed, offset, lse = torch.zeros(1), torch.zeros(1), torch.zeros(h, t)
    _check(torch.ops.aten._cudnn_attention_backward,
           cudnn_backward_args(q, q, k, v, q, lse, seed, offset, cu, 6, 0.125))
