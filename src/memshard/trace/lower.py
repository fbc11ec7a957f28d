"""An exported training forward (ATen graph) → memshard's graph IR.

Three passes over the FX graph:

1. **dims**: every tensor axis gets atoms (``dims.py``) by the rule of its ATen op family
   (``rules.py``): views and transposes regroup or permute atoms, broadcasts and contractions
   unify them, ``split`` / ``slice`` / ``cat`` along an axis factor it into (pieces × piece).
   An op without a rule gets fresh atoms on its output.
2. **ops**: every node that depends on a parameter and computes (not a view) becomes an IR op
   over the *leaf* atoms, so a head split of a fused projection is a plain ``Shard`` of one leaf.
   What it saves for backward comes from running it on fake tensors (``probe.py``), except
   the two kernels that save differently on the GPUs we plan for (dropout keeps a 1-byte mask,
   fused attention keeps q, k, v, its output and the log-sum-exp). Nodes that depend on no
   parameter (masks, positions, shifted labels) are computed in full on every device: they are
   the IR's inputs; those computed from no placeholder at all (a math attention path's causal
   mask) are ``Graph.made_inputs``, made where they are read. Ops without a rule keep every dim
   whole (replicated) and are counted in ``Graph.unknown_ops``. Each op keeps the ATen call the runtime makes for it
   (``program.AtenCall``, in ``Graph.traced``).
3. **layers**: ops inside ``<container>.<i>.`` modules get ``layer = i`` and a role (their
   path and ordinal inside the layer); when all layers have the same roles and their dims
   correspond one to one, the ILP shares variables across layers as for the built-in models.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any, NamedTuple

import torch
from torch.fx import Node

from memshard.core.errors import MemshardError
from memshard.core.graph import (
    LAYOUT_COPY,
    Graph,
    Op,
    Operand,
    Precision,
    SavedBuffer,
    TensorKind,
    TensorSpec,
)
from memshard.trace.dims import Atoms, DimConflict
from memshard.trace.export import WRAPPER_PREFIX
from memshard.trace.probe import ArgSpec, Saved, probe
from memshard.trace.program import AtenCall, InputSlot, TokenCount, TracedProgram
from memshard.trace.rules import SKIP, Desc, RuleState, packet_of, rule_for, tensor_args


class RawOp(NamedTuple):
    """A node that becomes an IR op, before the ops are named."""

    node: Node
    desc: Desc
    inputs: list[Node]


class _Lowering:
    def __init__(self, ep: torch.export.ExportedProgram, name: str, precision: Precision):
        self.ep = ep
        self.name = name
        self.precision = precision
        sig = ep.graph_signature
        self.param_fqn = {k: _strip(v) for k, v in sig.inputs_to_parameters.items()}
        self.user_inputs = list(sig.user_inputs)
        self.atoms = Atoms()
        self.axes: dict[Node, Any] = {}  # node → list of atom tuples (or a list of those)
        self.rules = RuleState(self.atoms, self.axes, frozenset(self.param_fqn))
        self.grad: dict[Node, bool] = {}
        self.made: set[Node] = set()  # computed from no placeholder: a factory-made constant
        self.base: dict[Node, Node] = {}  # view → the node that owns the data
        self.descs: dict[Node, Desc] = {}
        # autocast's cast of a parameter (and views of it) → its bytes per element; the
        # parameters whose copy is already priced as an op's buffer
        self.param_casts: dict[Node, int] = {}
        self.buffered_casts: set[Node] = set()
        self.unknown: Counter[str] = Counter()
        # pass 2: the IR's tensors, each node's tensor name, and every atom's dim name
        self.tensors: dict[str, TensorSpec] = {}
        self.ir_name: dict[Node, str] = {}
        self.names: dict[int, str] = {}

    # -- pass 1: dims -------------------------------------------------------------------------
    def run_dims(self) -> None:
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.grad[node] = node.name in self.param_fqn
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    self.axes[node] = [self.atoms.axis(n) for n in val.shape]
            elif node.op == "call_function":
                if all(a in self.made for a in node.all_input_nodes):
                    self.made.add(node)
                self._dims_of(node)

    def _dims_of(self, node: Node) -> None:
        packet = packet_of(node)
        args = [node.args[0]] if packet == "getitem" else tensor_args(node)
        self.grad[node] = any(self.grad.get(a, False) for a in args)
        if packet in SKIP or node.meta.get("val") is None:
            return
        if packet == "getitem":
            self._getitem(node)
            return
        if packet == "_to_copy" and self.base.get(args[0], args[0]).name in self.param_fqn:
            self._param_cast(node, args[0])
            return
        out_axes, desc = self._apply_rule(node, packet)
        self.axes[node] = out_axes
        if desc is None:  # a view: owns no data
            self.base[node] = self.base.get(args[0], args[0])
            if args[0] in self.param_casts:
                self.param_casts[node] = self.param_casts[args[0]]
        else:
            self.descs[node] = desc

    def _param_cast(self, node: Node, param: Node) -> None:
        """Autocast's cast of a parameter (``_to_copy`` to bf16): read as the parameter itself,
        so that its gradient is the parameter's (partial where its consumer's batch is split,
        one layout for every use of a tied weight); the cast copy an op saves for backward is
        priced as that op's buffer, laid out as the weight is there (``_op``)."""
        self.axes[node] = self.axes[param]
        self.base[node] = self.base.get(param, param)
        self.param_casts[node] = node.meta["val"].element_size()

    def _getitem(self, node: Node) -> None:
        """One output of a multi-output node: a piece of a split, an output of an op without a
        rule (whole, like its op), or a fused kernel's output (``native_dropout``'s)."""
        parent, index = node.args
        self.axes[node] = self.axes[parent][index]
        up = self.descs.get(parent)
        if up is not None and up.whole:
            self.descs[node] = Desc(up.kind, whole=True, item=index)
        elif up is not None and up.item == 0:  # a fused kernel's output (then what it keeps)
            if index == 0:
                self.descs[node] = up
        elif up is not None:
            self.descs[node] = Desc("select", unsplittable=up.unsplittable, index=index)

    def _apply_rule(self, node: Node, packet: str) -> tuple[Any, Desc | None]:
        rule = rule_for(node, packet)
        if rule is not None:
            try:
                return rule(self.rules, node, packet)
            except DimConflict:
                pass
        # No rule, or the rule's dims conflict: fresh atoms, every dim whole.
        if self.grad[node]:
            self.unknown[f"aten.{packet}"] += 1
        val = node.meta["val"]
        vals = val if isinstance(val, (tuple, list)) else [val]
        fresh = [[self.atoms.axis(int(n)) for n in v.shape] for v in vals if isinstance(v, torch.Tensor)]
        return (fresh if isinstance(val, (tuple, list)) else fresh[0]), Desc(f"aten.{packet}", whole=True)

    # -- pass 2: ops --------------------------------------------------------------------------
    def leaves(self, node: Node) -> tuple[int, ...]:
        return self.atoms.leaves([a for ax in self.axes[node] for a in ax])

    def build(self, fixed_kwargs: dict | None = None) -> Graph:
        loss_node = self._loss_node()
        raw = self._collect()
        layers = self._name_dims(raw)
        ops, calls, synthetic = [], {}, {}
        for r in raw:
            layer, role, op_name = layers[r.node]
            call = calls[op_name] = self._call(r)
            operands = [self._operand(a, i, r.desc) for i, a in enumerate(r.inputs)]
            if r.desc.kind == "cross_entropy":  # the number of counted tokens, from the full labels
                count = f"{r.node.name}.tokens"
                self.tensors[count] = TensorSpec(count, (), 8, TensorKind.INPUT)
                operands.append(Operand(count, ()))
                synthetic[count] = TokenCount(r.inputs[1].name, call.ignore_index)
            ops.append(self._op(r, operands, layer, role, op_name))
        program = TracedProgram(
            self.ep, calls, synthetic,
            {self.param_fqn[n.name]: self._torch_axes(n) for n in self._param_nodes()},
            dict(fixed_kwargs or {}))
        return Graph(
            name=self.name, tensors=self.tensors, ops=tuple(ops), loss=self.ir_name[loss_node],
            precision=self.precision, num_layers=len({op.layer for op in ops if op.layer is not None}),
            unknown_ops=dict(sorted(self.unknown.items())), traced=program,
            made_inputs=frozenset(name for node, name in self.ir_name.items()
                                  if node in self.made and self.tensors[name].kind is TensorKind.INPUT),
        )

    def _loss_node(self) -> Node:
        loss_node = None
        for node in self.ep.graph.nodes:
            if node.op == "output":
                loss_node = self.base.get(node.args[0][0], node.args[0][0])
        if loss_node is None or not self.grad.get(loss_node, False):
            raise MemshardError("the loss does not depend on any parameter: nothing to train")
        return loss_node

    def _collect(self) -> list[RawOp]:
        """The nodes that become ops, in order, with the IR tensors they read and make."""
        raw = []
        for node in self.ep.graph.nodes:
            if node.op != "call_function" or node not in self.descs or not self.grad[node]:
                continue
            val = node.meta["val"]
            if isinstance(val, (tuple, list)):  # its getitems are the ops
                continue
            inputs = self._inputs(node)
            for a in inputs:
                self._tensor_of(a)
            raw.append(RawOp(node, self.descs[node], inputs))
            shape = tuple(self.atoms.size[a] for a in self.leaves(node))
            self.tensors[node.name] = TensorSpec(node.name, shape, val.element_size(), TensorKind.ACTIVATION)
            self.ir_name[node] = node.name
        return raw

    def _tensor_of(self, n: Node) -> str:
        """The IR tensor an op input reads: a parameter (by FQN) or an input, made on first use."""
        n = self.base.get(n, n)
        if n in self.ir_name:
            return self.ir_name[n]
        val = n.meta["val"]
        if n.name in self.param_fqn:
            name, kind, nbytes = self.param_fqn[n.name], TensorKind.PARAMETER, self.precision.param_bytes
        elif self.grad[n]:
            raise AssertionError(f"activation {n.name} used before it is made")
        else:
            name, kind, nbytes = n.name, TensorKind.INPUT, val.element_size()
        shape = tuple(self.atoms.size[a] for a in self.leaves(n))
        self.tensors[name] = TensorSpec(name, shape, nbytes, kind)
        self.ir_name[n] = name
        return name

    def _name_dims(self, raw: list[RawOp]) -> dict[Node, tuple[int | None, str | None, str]]:
        """Each op's (layer, role, name), and ``self.names``: shared by layers when their dims
        correspond, else every op is planned on its own."""
        layers = self._layers([r.node for r in raw])
        self.names = self._dim_names(raw, layers, share=True)
        if not self._consistent(raw, layers, self.names):
            layers = {n: (lay, None, name) for n, (lay, _, name) in layers.items()}
            self.names = self._dim_names(raw, layers, share=False)
        return layers

    def _op(self, r: RawOp, operands: list[Operand], layer: int | None, role: str | None, op_name: str) -> Op:
        node, desc, inputs = r
        names = self.names
        output = Operand(self.ir_name[node], tuple(names[x] for x in self.leaves(node)))
        op_dims = {d for o in (*operands, output) for d in o.dims}
        # A dim on two axes of one tensor (scores [b, n, s, s] of unfused attention) is two
        # different dims of the op that tracing cannot tell apart: it stays whole.
        doubled = {d for o in (*operands, output) for d, n in Counter(o.dims).items() if n > 1}
        named = [self._name(x, desc) for x in self.atoms.leaves(desc.unsplittable)]
        if desc.causal:
            named += [self.names[x] for x in self.atoms.leaves(desc.renamed)]
        unsplittable = (tuple(sorted(op_dims)) if desc.whole
                        else tuple(dict.fromkeys([d for d in named if d in op_dims] + sorted(doubled))))
        saved = desc.saved if desc.saved is not None else self._probe(node, inputs)
        saves_inputs = tuple(
            i for i in saved.inputs
            if i < len(inputs) and self.tensors[operands[i].tensor].kind is TensorKind.ACTIVATION
        )
        buffers = tuple(
            SavedBuffer(f"{op_name}.saved{j}", *self._buffer_layout(shape, nbytes, node, inputs))
            for j, (shape, nbytes) in enumerate(saved.buffers)
        ) + self._cast_buffers(op_name, saved, inputs, operands)
        return Op(
            name=op_name, kind=desc.kind, inputs=tuple(operands), output=output,
            reduced_dims=tuple(dict.fromkeys(self._name(x, desc) for x in self.atoms.leaves(desc.reduced))),
            unsplittable_dims=unsplittable, stats_per_row=desc.stats_per_row,
            saves_inputs=saves_inputs, saves_output=saved.output, buffers=buffers,
            flops_per_point=desc.flops_per_point, backward_flops_ratio=desc.backward_flops_ratio, causal=desc.causal,
            layer=layer, role=role,
        )

    def _cast_buffers(self, op_name: str, saved: Saved, inputs: list[Node], operands: list[Operand]) -> tuple:
        """The bf16 copies of weights an op keeps for backward. Autocast casts a weight once per
        forward (its cache), so a copy is priced once, with the first op that keeps it: that
        one's backward is the last to need it."""
        out = []
        for i in saved.inputs:
            if i < len(inputs) and inputs[i] in self.param_casts:
                param = self.base[inputs[i]]  # (one cast per forward: the trace may make more)
                if param not in self.buffered_casts:
                    self.buffered_casts.add(param)
                    out.append(SavedBuffer(f"{op_name}.cast{i}", operands[i].dims, self.param_casts[inputs[i]]))
        return tuple(out)

    def _name(self, atom: int, desc: Desc) -> str:
        renamed = self.atoms.leaves(desc.renamed)
        return self.names[atom] + "_k" if atom in renamed else self.names[atom]

    def _operand(self, a: Node, i: int, desc: Desc) -> Operand:
        base = self.base.get(a, a)
        return Operand(self.ir_name[base], tuple(d for ax in self._axis_names(base, i, desc) for d in ax))

    def _axis_names(self, a: Node, i: int, desc: Desc) -> list[tuple[str, ...]]:
        """The op-local dim names of each torch axis of ``a`` (input ``i`` of the op)."""
        axes = [self.atoms.leaves(ax) for ax in self.axes[a]]
        renamed = set(self.atoms.leaves(desc.renamed)) if i in desc.renamed_inputs else set()
        # Rename only the last axis made of the key atoms (a mask [b, 1, s, s] keeps its rows).
        last = max((j for j, ax in enumerate(axes) if ax and set(ax) <= renamed), default=None)
        return [tuple(self.names[x] + ("_k" if j == last else "") for x in ax) for j, ax in enumerate(axes)]

    def _call(self, r: RawOp) -> AtenCall:
        """How the runtime calls this op on local shards: the ATen target, its arguments with
        tensors as input indices, and the dims of every torch axis of the inputs and output."""
        node, desc, inputs = r
        names = self.names
        index = {a: i for i, a in enumerate(inputs)}

        def template(x):
            if isinstance(x, Node):
                return InputSlot(index[x]) if x in index else x.meta.get("val")
            if isinstance(x, (list, tuple)):
                return type(x)(template(y) for y in x)
            return x

        source = self._source(node)
        return AtenCall(
            target=source.target if source is not None else None,
            args=template(tuple(source.args)) if source is not None else (),
            kwargs={k: template(v) for k, v in source.kwargs.items()} if source is not None else {},
            item=desc.item,
            in_axes=[self._axis_names(a, i, desc) for i, a in enumerate(inputs)],
            out_axes=[tuple(names[x] for x in self.atoms.leaves(ax)) for ax in self.axes[node]],
            dtype=node.meta["val"].dtype,
            index=desc.index,
            pieces=tuple(names[x] for x in self.atoms.leaves(desc.unsplittable or ())),
            sizes={names[x]: self.atoms.size[x] for a in (*inputs, node) for ax in self.axes[a]
                   for x in self.atoms.leaves(ax)},
            **(_cross_entropy_options(node) if desc.kind == "cross_entropy" else {}),
        )

    def _param_nodes(self) -> list[Node]:
        return [n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self.param_fqn
                and n.users]

    def _torch_axes(self, node: Node) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(self.names.get(a, "?") for a in self.atoms.leaves(ax)) for ax in self.axes[node])

    def _inputs(self, node: Node) -> list[Node]:
        """The tensors an op reads: a split's piece reads the split's input."""
        if packet_of(node) != "getitem":
            return tensor_args(node)
        parent = node.args[0]
        return tensor_args(parent) if self.descs[node].item is not None else [parent.args[0]]

    def _source(self, node: Node) -> Node | None:
        """The node whose ATen call an op makes (none for a piece of a split)."""
        if packet_of(node) != "getitem":
            return node
        return node.args[0] if self.descs[node].item is not None else None

    def _probe(self, node: Node, inputs: list[Node]) -> Saved:
        source = self._source(node)
        if source is None or self.descs[node].kind in ("select", "cat", "copy", LAYOUT_COPY):
            return Saved((), False, ())
        if source is not node and node is not next(iter(source.users)):
            return Saved((), False, ())  # a multi-output op's saved tensors go to its first output
        specs = []

        def placeholder(a):
            if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor):
                v = a.meta["val"]
                specs.append(ArgSpec(tuple(int(n) for n in v.shape), tuple(int(s) for s in v.stride()),
                                     v.dtype, bool(self.grad.get(a)) and v.is_floating_point()))
                return specs[-1]
            if isinstance(a, (list, tuple)):
                return type(a)(placeholder(x) for x in a)
            return a

        args = placeholder(tuple(source.args))
        kwargs = {k: placeholder(v) for k, v in source.kwargs.items() if k != "device"}
        saved = probe(source.target, args, kwargs, specs)
        return saved if saved is not None else Saved((), False, ())

    def _buffer_layout(self, shape, nbytes: int, node: Node, inputs: list[Node]) -> tuple[tuple[str, ...], int]:
        """A saved buffer's dims: the axes of the output (or else of an input) that its axes are,
        in order, skipping some and merging neighbours (a batched matmul keeps ``[b·n, s, d]``
        copies of its ``[b, n, s, d]`` operands); else one opaque replicated blob."""
        want = [int(n) for n in shape if n != 1]
        for t in (node, *inputs):
            sizes = [int(n) for n in t.meta["val"].shape]
            dims: list[str] = []
            i = j = 0
            while j < len(want) and i < len(sizes):
                group, have = [], 1
                while i < len(sizes) and have < want[j] and want[j] % (have * sizes[i]) == 0:
                    group.append(i)
                    have *= sizes[i]
                    i += 1
                if have == want[j]:
                    dims.extend(self.names[a] for k in group for a in self.atoms.leaves(self.axes[t][k]))
                    j += 1
                elif not group:
                    i += 1  # an axis the buffer does not have
                else:
                    break
            if j == len(want):
                return tuple(dims), nbytes
        return (), nbytes * math.prod(shape)

    # -- pass 3: layers and names ---------------------------------------------------------------
    def _layers(self, nodes: list[Node]) -> dict[Node, tuple[int | None, str | None, str]]:
        out = {}
        counts: Counter = Counter()
        per_layer: dict[int, list[str]] = defaultdict(list)
        for node in nodes:
            stack = node.meta.get("nn_module_stack") or {}
            path = _strip(list(stack.values())[-1][0]) if stack else ""
            m = re.match(r"^(.*?)\.(\d+)(?:\.(.*))?$", path)
            packet = packet_of(node)
            if packet == "getitem":
                item = self.descs[node].item
                packet = "select" if item is None else f"{packet_of(node.args[0])}{item}"
            if m:
                layer, rel = int(m.group(2)), m.group(3) or ""
                key = (layer, rel, packet)
                role = f"{rel}/{packet}#{counts[key]}" if rel else f"{packet}#{counts[key]}"
                counts[key] += 1
                name = f"{m.group(1)}.{layer}.{role}"
                per_layer[layer].append(role)
                out[node] = (layer, role, name)
            else:
                key = (None, path, packet)
                base = f"{path}/{packet}" if path else packet
                out[node] = (None, None, f"{base}#{counts[key]}")
                counts[key] += 1
        first = min(per_layer) if per_layer else None
        if not all(r == per_layer[first] for r in per_layer.values()):
            out = {n: (lay, None, name) for n, (lay, _, name) in out.items()}
        return out

    def _dim_names(self, ops_raw: list[RawOp], layers, share: bool) -> dict[int, str]:
        """Readable dim names; with ``share``, a layer's own dims take the names of the first
        layer's corresponding dims, so every copy of a role has the same dims (one set of ILP
        variables per role)."""
        A = self.atoms
        names: dict[int, str] = {}
        ids = next((n for n in self.ep.graph.nodes if n.op == "placeholder" and n.name in self.user_inputs), None)
        if ids is not None and len(self.axes.get(ids, [])) == 2:  # token ids: batch and sequence
            for letter, ax in zip("bs", self.axes[ids]):
                if len(A.leaves(ax)) == 1:
                    names[A.leaves(ax)[0]] = letter
        used = set(names.values())
        counter = iter(range(1 << 30))

        def fresh() -> str:
            name = f"d{next(counter)}"
            while name in used:
                name = f"d{next(counter)}"
            used.add(name)
            return name

        atoms_of = {node: [self.leaves(self.base.get(a, a)) for a in inputs] + [self.leaves(node)]
                    for node, _, inputs in ops_raw}
        atom_layers: dict[int, set] = defaultdict(set)
        for node, per_operand in atoms_of.items():
            for atoms in per_operand:
                for a in atoms:
                    atom_layers[a].add(layers[node][0])
        first_of_role: dict[str, tuple[int, list]] = {}
        for node, per_operand in atoms_of.items():
            layer, role, _ = layers[node]
            ref_layer, ref = first_of_role.setdefault(role, (layer, per_operand)) if share and role else (layer, per_operand)
            for atoms, ref_atoms in zip(per_operand, ref):
                for a, r in zip(atoms, ref_atoms):
                    if a in names:
                        continue
                    local = r in names and atom_layers[r] == {ref_layer} and atom_layers[a] == {layer}
                    names[a] = names[r] if local and r != a else fresh()
        return names

    def _consistent(self, ops_raw: list[RawOp], layers, names) -> bool:
        """Every copy of a role has the same dims, and no op has two dims of one name."""
        dims_of_role: dict[str, tuple] = {}
        for node, _, inputs in ops_raw:
            per_operand = [self.leaves(self.base.get(a, a)) for a in inputs] + [self.leaves(node)]
            atoms = {a for atoms in per_operand for a in atoms}
            if len({names[a] for a in atoms}) != len(atoms):
                return False
            role = layers[node][1]
            dims = tuple(tuple(names[a] for a in atoms) for atoms in per_operand)
            if role is not None and dims_of_role.setdefault(role, dims) != dims:
                return False
        return True


def _cross_entropy_options(node: Node) -> dict:
    """``cross_entropy_loss``'s reduction and ignored label, and what the split kernel lacks."""
    args = list(node.args) + [None] * 6
    out = {
        "reduction": node.kwargs.get("reduction", args[3] if args[3] is not None else 1),
        "ignore_index": node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100),
    }
    smoothing = node.kwargs.get("label_smoothing", args[5] or 0.0)
    if node.kwargs.get("weight", args[2]) is not None or smoothing:
        out["unsupported"] = "class weights or label smoothing"
    return out


def _strip(fqn: str) -> str:
    """A module path without the export wrapper's own name."""
    if fqn == WRAPPER_PREFIX.rstrip("."):
        return ""
    return fqn[len(WRAPPER_PREFIX):] if fqn.startswith(WRAPPER_PREFIX) else fqn


def lower(ep: torch.export.ExportedProgram, name: str, precision: Precision, fixed_kwargs: dict | None = None) -> Graph:
    """The graph IR of an exported training forward (see :func:`memshard.trace.trace_module`);
    ``fixed_kwargs``: the call's non-tensor keyword arguments, part of the trace."""
    lowering = _Lowering(ep, name, precision)
    lowering.run_dims()
    return lowering.build(fixed_kwargs)
