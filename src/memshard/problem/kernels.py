"""Compute time: each op's kernels priced by a roofline on the device (``core/hardware.py``).

An op runs, per micro-batch, a forward and a backward on its local shard (a strategy's local
sizes). Each kernel takes the longer of its FLOPs at the rate that kernel reaches and its
bytes at the memory bandwidth streaming kernels reach, plus the device's kernel overhead:

* **GEMMs** (``linear``, ``matmul``): forward ``C[M,N] = A[M,K]·B[K,N]`` (times any batch
  dims), backward the two GEMMs ``dA = dC·Bᵀ`` and ``dB = Aᵀ·dC``. Rate: the best GEMMs'
  fraction of peak, times the wave quantisation of the output's tiles over the device's
  multiprocessors (a TP split that leaves 1.3 waves runs 2), for the tile that fills them
  best (``TILES``: a smaller tile fills better, at a lower rate). Bytes: A, B and C.
* **Fused attention** (``sdpa``, FlashAttention): its FLOPs (half the scores when causal, as
  the kernel skips the masked blocks) at the attention kernels' fraction of peak, backward
  2.5× the forward's FLOPs at 0.85 of that rate, both times the wave quantisation of its
  128-query blocks.
* **Everything else** (norms, softmax, dropout, activations, residual adds, rotary, the
  embedding and the loss) by its bytes: forward its inputs, output and saved buffers (an
  embedding reads only the rows it gathers); backward the output's gradient, the saved
  tensors read and the input gradients written.

A 4-byte (fp32) op runs at the device's FP32 rate. A replayed op costs its forward again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from memshard.core.graph import Graph, Op, Operand
from memshard.core.hardware import Hardware

GEMM_KINDS = ("linear", "matmul")
# Output tiles cuBLAS chooses among, with the fraction of the best GEMM rate each reaches (a
# smaller tile reuses less of what it loads): the heuristic picks the tile whose waves fill
# the multiprocessors best.
TILES = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.75), (64, 64, 0.6))
ATTENTION_BLOCK_ROWS = 128  # queries per FlashAttention block
ATTENTION_BACKWARD_RATE = 0.85  # its backward's rate over its forward's


@dataclass(frozen=True)
class KernelTime:
    """One op's seconds per micro-batch, forward and backward."""

    forward_s: float
    backward_s: float


def _numel(operand: Operand, local: dict[str, int]) -> int:
    return math.prod(local[d] for d in operand.dims)


def _bytes(graph: Graph, operand: Operand, local: dict[str, int]) -> int:
    return _numel(operand, local) * graph.tensors[operand.tensor].dtype_bytes


def _peak(hardware: Hardware, dtype_bytes: int) -> float:
    return hardware.peak_flops_fp32 if dtype_bytes >= 4 else hardware.peak_flops


def _waves(blocks: int, hardware: Hardware) -> float:
    """The fraction of the multiprocessors' waves a kernel of ``blocks`` blocks fills."""
    return _filled(blocks, hardware.streaming_multiprocessors)


def _filled(blocks: int, sms: int) -> float:
    if blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / sms) * sms)


@functools.lru_cache(maxsize=1 << 14)  # every strategy of every GEMM: its local sizes repeat
def _gemm_fill(batch: int, m: int, n: int, sms: int) -> float:
    """The fraction of the best GEMM rate ``batch`` products of an ``[m, n]`` output reach:
    the best tile's rate times the waves its tiles fill (either way round)."""
    return max(max(rate * _filled(batch * math.ceil(m / rows) * math.ceil(n / columns), sms),
                   rate * _filled(batch * math.ceil(n / rows) * math.ceil(m / columns), sms))
               for rows, columns, rate in TILES)


def streaming_time(nbytes: float, hardware: Hardware) -> float:
    """A memory-bound kernel moving ``nbytes``."""
    return hardware.kernel_overhead_s + nbytes / (hardware.memory_bandwidth * hardware.memory_efficiency)


def gemm_time(batch: int, m: int, n: int, k: int, dtype_bytes: int, hardware: Hardware) -> float:
    """``batch`` products ``[m,k]·[k,n]``: the longer of FLOPs and bytes, plus the overhead."""
    flops = 2.0 * batch * m * n * k
    fill = _gemm_fill(batch, m, n, hardware.streaming_multiprocessors)
    rate = _peak(hardware, dtype_bytes) * hardware.matmul_efficiency * fill
    moved = batch * (m * k + k * n + m * n) * dtype_bytes
    return hardware.kernel_overhead_s + max(flops / rate,
                                            moved / (hardware.memory_bandwidth * hardware.memory_efficiency))


def _gemm(op: Op, graph: Graph, local: dict[str, int], hardware: Hardware) -> KernelTime:
    """Forward ``A·B`` and backward ``dA``, ``dB``; batch dims are in A, B and the output."""
    a, b = op.inputs[0], op.inputs[1]
    out = set(op.output.dims)
    shared = set(a.dims) & set(b.dims)
    batch = math.prod(local[d] for d in shared & out)
    k = math.prod(local[d] for d in shared - out)
    m = math.prod(local[d] for d in a.dims if d not in shared)
    n = math.prod(local[d] for d in b.dims if d not in shared)
    dtype = graph.tensors[a.tensor].dtype_bytes
    forward = gemm_time(batch, m, n, k, dtype, hardware)
    backward = gemm_time(batch, m, k, n, dtype, hardware) + gemm_time(batch, k, n, m, dtype, hardware)
    return KernelTime(forward, backward)


def _attention(op: Op, graph: Graph, local: dict[str, int], hardware: Hardware) -> KernelTime:
    points = math.prod(local[d] for d in op.dims)
    flops = op.flops_per_point * points * (0.5 if op.causal else 1.0)
    query = op.output
    value = set(op.inputs[2].dims) if len(op.inputs) > 2 else set(query.dims)
    head_size = math.prod(local[d] for d in query.dims if d in op.unsplittable_dims and d in value)
    blocks = math.ceil(_numel(query, local) / head_size / ATTENTION_BLOCK_ROWS)
    rate = (_peak(hardware, graph.tensors[query.tensor].dtype_bytes) * hardware.attention_efficiency
            * _waves(blocks, hardware))
    forward = hardware.kernel_overhead_s + flops / rate
    backward = hardware.kernel_overhead_s + flops * op.backward_flops_ratio / (rate * ATTENTION_BACKWARD_RATE)
    return KernelTime(forward, backward)


def _streaming(op: Op, graph: Graph, local: dict[str, int], hardware: Hardware) -> KernelTime:
    out = _bytes(graph, op.output, local)
    buffers = sum(math.prod(local[d] for d in buf.dims) * buf.dtype_bytes for buf in op.buffers)
    if op.kind == "embedding":  # a gather of rows: the rows read, the output written
        inputs = _bytes(graph, op.inputs[0], local) + out
        return KernelTime(streaming_time(inputs + out, hardware), streaming_time(3 * out, hardware))
    inputs = sum(_bytes(graph, x, local) for x in op.inputs)
    saved = sum(_bytes(graph, op.inputs[j], local) for j in op.saves_inputs) + (out if op.saves_output else 0)
    forward = streaming_time(inputs + out + buffers, hardware)
    backward = streaming_time(out + saved + inputs + buffers, hardware)
    return KernelTime(forward, backward)


def op_time(op: Op, graph: Graph, local: dict[str, int], hardware: Hardware) -> KernelTime:
    """``op``'s forward and backward seconds per micro-batch on its local sizes ``local``."""
    if op.kind in GEMM_KINDS and len(op.inputs) >= 2:
        return _gemm(op, graph, local, hardware)
    if op.kind == "sdpa":
        return _attention(op, graph, local, hardware)
    return _streaming(op, graph, local, hardware)


def optimizer_step_time(state_bytes: float, gradient_bytes: float, parameter_bytes: float,
                        hardware: Hardware) -> float:
    """Adam's update of a local shard, memory-bound: its states read and written, its
    gradient read, its weight written."""
    if not (state_bytes or parameter_bytes):
        return 0.0
    return streaming_time(2 * state_bytes + gradient_bytes + parameter_bytes, hardware)
