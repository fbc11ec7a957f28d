"""A small helper for writing model graphs: tensors, parameters and the common layers.

Each layer function appends one op whose named dims, saved tensors and FLOPs follow what
the PyTorch kernel keeps for backward (Korthikanti et al. 2022, table 2, for the GPT layer).
"""

from __future__ import annotations

from memshard.core.graph import (
    ACTIVATION_FLOPS_PER_POINT,
    Graph,
    Op,
    Operand,
    Precision,
    SavedBuffer,
    TensorKind,
    TensorSpec,
)

DROPOUT_MASK_BYTES = 1  # torch keeps a bool mask per element
LSE_BYTES = 4  # the flash-attention logsumexp is fp32
INDEX_BYTES = 8  # int64 token ids and labels


class GraphBuilder:
    def __init__(self, name: str, precision: Precision, dims: dict[str, int]):
        self.name = name
        self.precision = precision
        self.dims = dict(dims)  # global dim name → size; tensors are declared by dim names
        self.tensors: dict[str, TensorSpec] = {}
        self.ops: list[Op] = []
        self.layer: int | None = None
        self.prefix = ""

    # -- declarations ------------------------------------------------------------------------
    def _shape(self, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.dims[d] for d in dims)

    def input(self, name: str, dims: tuple[str, ...], dtype_bytes: int = INDEX_BYTES) -> str:
        self.tensors[name] = TensorSpec(name, self._shape(dims), dtype_bytes, TensorKind.INPUT)
        return name

    def param(self, name: str, dims: tuple[str, ...]) -> str:
        name = self.prefix + name
        self.tensors[name] = TensorSpec(
            name, self._shape(dims), self.precision.param_bytes, TensorKind.PARAMETER
        )
        return name

    def activation(self, name: str, dims: tuple[str, ...], dtype_bytes: int | None = None) -> str:
        name = self.prefix + name
        nbytes = self.precision.activation_bytes if dtype_bytes is None else dtype_bytes
        self.tensors[name] = TensorSpec(name, self._shape(dims), nbytes, TensorKind.ACTIVATION)
        return name

    def begin_layer(self, index: int | None, prefix: str = "") -> None:
        self.layer = index
        self.prefix = prefix

    def op(
        self,
        name: str,
        kind: str,
        inputs: list[tuple[str, tuple[str, ...]]],
        output: tuple[str, tuple[str, ...]],
        **fields,
    ) -> str:
        full = self.prefix + name
        self.ops.append(
            Op(
                name=full,
                kind=kind,
                inputs=tuple(Operand(t, d) for t, d in inputs),
                output=Operand(*output),
                layer=self.layer,
                role=name if self.layer is not None else None,
                **fields,
            )
        )
        return output[0]

    def build(self, loss: str, num_layers: int, seq: int) -> Graph:
        return Graph(
            name=self.name,
            tensors=dict(self.tensors),
            ops=tuple(self.ops),
            loss=loss,
            precision=self.precision,
            num_layers=num_layers,
            seq=seq,
        )

    # -- layers --------------------------------------------------------------------------------
    def linear(
        self,
        name: str,
        x: str,
        x_dims: tuple[str, ...],
        w_dims: tuple[str, ...],
        out_dims: tuple[str, ...],
        bias: bool,
        weight: str | None = None,
    ) -> str:
        """``y = x · w (+ b)``: dims shared by x and w are contracted. Saves x for dW."""
        w = weight or self.param(f"{name}.weight", w_dims)
        inputs = [(x, x_dims), (w, w_dims)]
        if bias:
            bias_dims = tuple(d for d in out_dims if d not in x_dims)
            inputs.append((self.param(f"{name}.bias", bias_dims), bias_dims))
        y = self.activation(f"{name}.out", out_dims)
        return self.op(
            name, "linear", inputs, (y, out_dims),
            saves_inputs=(0,), flops_per_point=2.0, backward_flops_ratio=2.0,
        )

    def norm(self, name: str, x: str, dims: tuple[str, ...], over: str, bias: bool) -> str:
        """LayerNorm (bias=True) or RMSNorm (bias=False) over ``over``; saves its input.

        The per-row statistics (mean and rstd, or rstd) are fp32 and tiny; they are counted
        as part of the op's transient, not of the saved activations (Korthikanti et al.).
        """
        inputs = [(x, dims), (self.param(f"{name}.weight", (over,)), (over,))]
        if bias:
            inputs.append((self.param(f"{name}.bias", (over,)), (over,)))
        y = self.activation(f"{name}.out", dims)
        return self.op(
            name, "layernorm" if bias else "rmsnorm", inputs, (y, dims),
            reduced_dims=(over,), stats_per_row=2 if bias else 1,
            saves_inputs=(0,), flops_per_point=8.0, backward_flops_ratio=2.0,
        )

    def dropout(self, name: str, x: str, dims: tuple[str, ...]) -> str:
        """Saves only its mask: one byte per element."""
        y = self.activation(f"{name}.out", dims)
        return self.op(
            name, "dropout", [(x, dims)], (y, dims),
            buffers=(SavedBuffer(f"{self.prefix}{name}.mask", dims, DROPOUT_MASK_BYTES),),
            flops_per_point=2.0,
        )

    def add(self, name: str, a: str, b: str, dims: tuple[str, ...]) -> str:
        y = self.activation(f"{name}.out", dims)
        return self.op(name, "add", [(a, dims), (b, dims)], (y, dims), flops_per_point=1.0)

    def mul(self, name: str, a: str, b: str, dims: tuple[str, ...]) -> str:
        """Elementwise product; saves both factors."""
        y = self.activation(f"{name}.out", dims)
        return self.op(
            name, "mul", [(a, dims), (b, dims)], (y, dims), saves_inputs=(0, 1), flops_per_point=1.0
        )

    def activation_fn(self, name: str, kind: str, x: str, dims: tuple[str, ...]) -> str:
        """GeLU / SiLU: saves its input."""
        y = self.activation(f"{name}.out", dims)
        return self.op(name, kind, [(x, dims)], (y, dims), saves_inputs=(0,),
                       flops_per_point=ACTIVATION_FLOPS_PER_POINT[kind])

    def softmax(self, name: str, x: str, dims: tuple[str, ...], over: str) -> str:
        """Scaled, masked softmax; saves its output."""
        y = self.activation(f"{name}.out", dims)
        return self.op(
            name, "softmax", [(x, dims)], (y, dims),
            reduced_dims=(over,), stats_per_row=2, saves_output=True, flops_per_point=5.0,
        )

    def matmul(
        self,
        name: str,
        a: tuple[str, tuple[str, ...]],
        b: tuple[str, tuple[str, ...]],
        out_dims: tuple[str, ...],
    ) -> str:
        """Activation × activation (attention scores, context); saves both operands."""
        y = self.activation(f"{name}.out", out_dims)
        return self.op(
            name, "matmul", [a, b], (y, out_dims),
            saves_inputs=(0, 1), flops_per_point=2.0, backward_flops_ratio=2.0,
        )

    def embedding(self, name: str, ids: str, ids_dims: tuple[str, ...], table: str, table_dims: tuple[str, ...], out_dims: tuple[str, ...]) -> str:
        """Lookup ``table[ids]``: the table's row dim is contracted (a one-hot product), so a
        vocab-split table leaves a partial sum, as in Megatron's vocab-parallel embedding."""
        y = self.activation(f"{name}.out", out_dims)
        return self.op(
            name, "embedding", [(ids, ids_dims), (table, table_dims)], (y, out_dims),
            saves_inputs=(0,), flops_per_point=0.0,
        )

    def cross_entropy(self, name: str, logits: str, dims: tuple[str, ...], labels: str, label_dims: tuple[str, ...], over: str) -> str:
        """Mean token loss; keeps the logits for backward (softmax is recomputed from them).
        The batch and sequence dims are summed into the scalar (a partial sum when split)."""
        loss = self.activation(f"{name}.out", (), dtype_bytes=4)
        return self.op(
            name, "cross_entropy", [(logits, dims), (labels, label_dims)], (loss, ()),
            reduced_dims=(over,), stats_per_row=3, saves_inputs=(0, 1), flops_per_point=5.0,
        )

    # -- blocks shared by GPT and BERT ------------------------------------------------------------
    def attention_block(self, x: str, dropout: bool, fused: bool = False) -> str:
        """Megatron-style multi-head attention on ``x[b,s,h]`` (unfused: scores, softmax,
        dropout, context; or ``fused``: one causal flash-attention kernel), up to the output
        projection and its dropout, before the residual."""
        bsh, bsnd, btnd, bnst = ("b", "s", "h"), ("b", "s", "n", "d"), ("b", "t", "n", "d"), ("b", "n", "s", "t")
        q = self.linear("attn.q", x, bsh, ("h", "n", "d"), bsnd, bias=True)
        k = self.linear("attn.k", x, bsh, ("h", "n", "d"), bsnd, bias=True)
        v = self.linear("attn.v", x, bsh, ("h", "n", "d"), bsnd, bias=True)
        if fused:
            ctx = self.flash_attention("attn.sdpa", q, k, v)
        else:
            scores = self.matmul("attn.scores", (q, bsnd), (k, btnd), bnst)
            probs = self.softmax("attn.softmax", scores, bnst, "t")
            if dropout:
                probs = self.dropout("attn.attn_dropout", probs, bnst)
            ctx = self.matmul("attn.context", (probs, bnst), (v, btnd), bsnd)
        a = self.linear("attn.proj", ctx, bsnd, ("n", "d", "h"), bsh, bias=True)
        return self.dropout("attn.resid_dropout", a, bsh) if dropout else a

    def flash_attention(self, name: str, q: str, k: str, v: str, q_dims: tuple[str, ...] = ("b", "s", "n", "d"),
                        kv_dims: tuple[str, ...] = ("b", "t", "n", "d")) -> str:
        """Causal fused attention on ``q[q_dims]``, ``k, v[kv_dims]`` (GPT's heads by default;
        LLaMA's grouped queries ``[b,s,e,g,d]``): saves its inputs, its output and the fp32
        logsumexp per query row (flash attention's); the scores are recomputed in backward,
        never stored."""
        lse_dims = ("b", *(d for d in q_dims if d not in ("b", "s", "d")), "s")  # one per query row
        return self.op(
            name, "sdpa", [(q, q_dims), (k, kv_dims), (v, kv_dims)], (self.activation(f"{name}.out", q_dims), q_dims),
            reduced_dims=("t",), unsplittable_dims=("t", "d"), saves_inputs=(0, 1, 2), saves_output=True,
            buffers=(SavedBuffer(f"{self.prefix}{name}.lse", lse_dims, LSE_BYTES),),
            flops_per_point=4.0, backward_flops_ratio=2.5, causal=True,
        )

    def gelu_mlp_block(self, x: str, dropout: bool) -> str:
        """h → f → h with GeLU, and the output dropout, before the residual."""
        bsh, bsf = ("b", "s", "h"), ("b", "s", "f")
        u = self.linear("mlp.fc", x, bsh, ("h", "f"), bsf, bias=True)
        u = self.activation_fn("mlp.gelu", "gelu", u, bsf)
        o = self.linear("mlp.proj", u, bsf, ("f", "h"), bsh, bias=True)
        return self.dropout("mlp.resid_dropout", o, bsh) if dropout else o
