"""Memory a training step holds only for a moment, and memory outside PyTorch's allocator: the terms that decide the
peak beside the weights, gradients, optimizer states and kept activations (backend/plan/costs.py).

Each is a plain function of the plan's shapes with its why. The peak of a step is the larger of two moments:
  loss      the end of the forward on the last stage: every kept activation, plus the loss's fp32 logits, their
            softmax and its gradient, plus FSDP's root unit (embedding, head) and the last block still unsharded
  backward  a layer's backward: every kept activation, that layer rebuilt by recompute, FSDP's gathered weights of
            two blocks (prefetch), their gradients (bf16 and the fp32 copy reduce-scattered) and the head's gradient
Then the caching allocator's fragmentation (a fraction of what is allocated: the one fitted memory constant, on
one named calibration row) and what lives outside the allocator (CUDA context, NCCL buffers: assumed figures).
"""
from __future__ import annotations

GiB = 2 ** 30
MiB = 2 ** 20
CUDA_CONTEXT = 0.5 * GiB     # CUDA 12 context with lazy module loading on H100: ~500 MiB (assumed, typical nvidia-smi reading)
NCCL_BUFFSIZE = 4 * MiB      # NCCL's default NCCL_BUFFSIZE (NCCL environment-variable documentation)
NCCL_CHANNELS = 16           # channels a communicator opens on NVLink/IB (assumed; NCCL picks 2-32)


def loss_bytes(tokens: float, vocab: float, fused: bool) -> float:
    """Peak bytes of the cross-entropy over `tokens` × `vocab` logits (vocab already split by tp).

    torch's cross_entropy on logits upcast to fp32 (torchtitan, HF): in its backward the saved fp32 log-softmax,
    nll_loss's fp32 gradient and log_softmax_backward's fp32 result live together: 12 bytes a logit (the forward's
    bf16 logits + fp32 copy + log-softmax are 10). Megatron's fused vocab-parallel loss (GPT models) keeps the bf16
    logits and one fp32 softmax it overwrites with the gradient in place: 6 bytes a logit."""
    return (6.0 if fused else 12.0) * tokens * vocab


def fsdp_unsharded_bytes(block_params: float, root_params: float, head_params: float, moment: str,
                         reduce_bytes: int = 4) -> float:
    """Bytes FSDP2 holds unsharded (bf16 weights 2 bytes, gradients 2 bytes and their copy in the reduce dtype).

    The root unit (embedding, final norm, head) is not resharded after forward (FSDP2's fully_shard docs: the root's
    reshard_after_forward is set to False, its parameters being needed at once for backward): held all step.
    loss moment: the last block, kept unsharded after forward (torchtitan's reshard_after_forward=False for it), and
    the next block's backward prefetch. backward moment: the current and the prefetched block's weights, the
    current block's bf16 gradients and their copy in the reduce dtype (torchtitan's default fp32) for the
    reduce-scatter, and the head's bf16 gradient, waiting for the root's reduce-scatter at the end of backward."""
    root = 2.0 * root_params
    if moment == "loss":
        return root + 2 * 2.0 * block_params
    return root + 2 * 2.0 * block_params + (2.0 + reduce_bytes) * block_params + 2.0 * head_params


def outside_allocator_bytes(communicators: int) -> float:
    """CUDA context plus NCCL's buffers: per communicator, a send and a receive buffer of NCCL_BUFFSIZE per channel.
    Not in torch.cuda.max_memory_reserved (what torchtitan reports); counted against HBM."""
    return CUDA_CONTEXT + communicators * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


def fragmentation_bytes(allocated: float, fraction: float) -> float:
    """The caching allocator reserves more than it hands out: 2 MiB-rounded large blocks (kRoundLarge) and free
    pieces too small for the next request. Modelled as a fraction of the allocated peak, fitted on one calibration
    row (published.fit); the other measured memory rows validate it."""
    return fraction * allocated
