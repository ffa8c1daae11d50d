"""Every page of the explorer, by topic: the sidebar (app.py) and the Overview's map are both drawn from this list.

A topic page names the experiments it runs, so the Overview can say what runs where and link to it.
Icons are Material Symbols (bundled with Streamlit: no emoji font needed).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Topic:
    file: str
    title: str
    icon: str
    what: str                          # one line: what runs on the page
    experiments: tuple[str, ...] = ()

    @property
    def url_path(self) -> str:
        return self.file.removeprefix("pages/").removesuffix(".py")


SECTIONS: dict[str, list[Topic]] = {
    "Explorer": [
        Topic("pages/home.py", "Overview", ":material/explore:", "this map"),
        Topic("pages/runs.py", "Runs", ":material/history:", "every run on this server, by link, with downloads"),
    ],
    "Distributed": [
        Topic("pages/collectives.py", "Collectives, step by step", ":material/sync_alt:",
              "every collective built from send/recv, each transfer replayed", ("comm.collectives",)),
        Topic("pages/comm_bandwidth.py", "Collective bandwidth", ":material/network_check:",
              "gloo's collectives over a size sweep: algbw and busbw", ("comm.bandwidth",)),
        Topic("pages/data_parallel.py", "Data parallel & ZeRO", ":material/call_split:",
              "parameter servers, DDP, ZeRO-1/2/3, FSDP2, CPU offload: memory and bytes against 2ψ/2ψ/3ψ",
              ("parallel.dp_ps", "parallel.ddp", "parallel.zero", "parallel.fsdp")),
        Topic("pages/pipeline.py", "Pipeline parallel", ":material/view_timeline:",
              "GPipe, 1F1B, interleaved, zero bubble (H1, V), DualPipe-V, PipeDream: Gantt, bubble, recomputation's price",
              ("parallel.pipeline",)),
        Topic("pages/tensor_parallel.py", "Tensor & sequence parallel", ":material/view_column:",
              "column and row splits, Megatron MLP and attention, vocab-parallel loss, SP; DTensor beside ours",
              ("parallel.tp",)),
        Topic("pages/expert_parallel.py", "Expert parallel", ":material/hub:",
              "MoE experts over ranks: all-to-all dispatch and combine, capacity, dropped tokens", ("parallel.ep",)),
        Topic("pages/context_parallel.py", "Context parallel", ":material/donut_large:",
              "ring attention with the zigzag causal split, merged by log-sum-exp", ("parallel.cp",)),
        Topic("pages/mesh_parallel.py", "Compose parallelism", ":material/view_in_ar:",
              "tp, sp, cp, ep, pp (any schedule) and a dp strategy on one mesh: the tiny LLaMA, against one process",
              ("parallel.mesh",)),
        Topic("pages/checkpoints.py", "Checkpoints and failures", ":material/restore:",
              "sharded DCP checkpoints, a rank killed and the run resumed bit for bit; the interval trade-off",
              ("parallel.checkpoint",)),
    ],
    "Attention": [
        Topic("pages/kv_cache.py", "KV cache: MHA, MQA, GQA, MLA", ":material/database:",
              "bytes per token of each variant's cache, measured", ("attention.kv_cache",)),
        Topic("pages/variants_train.py", "Variants in training", ":material/trending_down:",
              "the four variants trained on one corpus", ("attention.variants_train",)),
        Topic("pages/flash_attention.py", "FlashAttention", ":material/bolt:",
              "Triton kernels forward and backward, traffic counted in the kernel", ("attention.flash",)),
        Topic("pages/nsa.py", "Native sparse attention", ":material/filter_alt:",
              "compressed, selected and window branches gated; KV bytes per query vs full attention", ("attention.nsa",)),
    ],
    "Compilers": [
        Topic("pages/autograd.py", "Autograd", ":material/functions:",
              "symbolic, numeric and automatic differentiation side by side", ("graph.autodiff",)),
        Topic("pages/fusion.py", "Autograd & fusion", ":material/merge:",
              "captured graphs, fusion passes, generated Triton kernels", ("graph.fusion",)),
        Topic("pages/placement.py", "Graph placement", ":material/account_tree:",
              "a graph split across ranks with send/recv", ("graph.placement",)),
    ],
    "Hardware": [
        Topic("pages/memory_hierarchy.py", "GPU memory hierarchy", ":material/memory:",
              "this CPU's roofline, latency and bandwidth per level measured beside GPU presets; decoding is memory-bound",
              ("hardware.roofline", "hardware.latency", "hardware.decode")),
        Topic("pages/gpu_execution.py", "GPU execution model", ":material/developer_board:",
              "a tiled Triton GEMM: grid, warps, threads, traffic counted per tile shape", ("hardware.gemm",)),
    ],
    "Serving": [
        Topic("pages/paged_attention.py", "Paged attention", ":material/grid_view:",
              "continuous batching on a paged block pool: the three wastes", ("kvcache.serve",)),
        Topic("pages/paged_decode.py", "Paged attention: the kernel", ":material/view_module:",
              "real K/V in the block pool through the Triton kernel: tables step by step, fork, swap, seed 000's examples",
              ("kvcache.paged_decode",)),
        Topic("pages/serving.py", "Serving: engine and simulator", ":material/speed:",
              "a continuous-batching engine on the tiny LLaMA and a simulator calibrated from it: TTFT, TPOT, load curves",
              ("serving.engine", "serving.simulate")),
        Topic("pages/speculative.py", "Speculative sampling", ":material/fast_forward:",
              "draft and target tiny LLaMAs; acceptance and a distribution test", ("decoding.speculative",)),
    ],
    "Models": [
        Topic("pages/moe_routing.py", "MoE routing", ":material/alt_route:",
              "softmax top-k, Switch, DeepSeek-V3 group-limited routing", ("models.moe_routing",)),
    ],
    "Numerics": [
        Topic("pages/number_formats.py", "Number formats", ":material/decimal_increase:",
              "bits, ranges, FP16 swamping, Kahan sums; INT8 weights, W8A8 and KV cache", ("numerics.formats", "numerics.int8")),
        Topic("pages/mixed_precision.py", "Mixed precision & loss scaling", ":material/stacked_line_chart:",
              "fp16 with fp32 master weights: underflow, loss scaling, GradScaler", ("numerics.mixed_precision",)),
    ],
    "Training": [
        Topic("pages/training_estimates.py", "Training pipeline & estimates", ":material/calculate:",
              "pretrain/SFT/RLHF map; time and memory estimates checked on small runs", ("estimate.training",)),
        Topic("pages/plan_training.py", "Plan a training run", ":material/event_note:",
              "a real model on a real cluster: memory, step, Gantt, MFU, days; every plan ranked; published rows' errors",
              ("plan.training", "plan.search")),
        Topic("pages/bellman.py", "MDPs & Bellman", ":material/grid_on:",
              "weather MRP, grid-world policy and value iteration", ("rl.bellman",)),
    ],
}
