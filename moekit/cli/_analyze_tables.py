"""Rich tables for ``moekit analyze``: the regime markers, the batch sweep, the bills, measurements."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from moekit.analysis.memory import GB
from moekit.analysis.report import PADDING_BLOCKS, Report
from moekit.bench.layer_measure import GRAPH_FLOOR_TARGET, HOST_TARGET_S, MEMORY_BOUND_MAX_BATCH, Measurement


def print_report(report: Report, console: Console) -> None:
    cfg, gpu, fmt = report.config, report.gpu, report.fmt
    layers = cfg.num_moe_layers or 1
    identity = (f" (and Z={cfg.num_identity_experts} identity experts: {cfg.routed_slots_per_token:g} experts run a "
                f"token)" if cfg.num_identity_experts else "")
    console.print(
        f"[bold]{report.model}[/]: one MoE layer has E={cfg.num_experts} routed experts, k={cfg.top_k}{identity}, "
        f"d={cfg.hidden_size}, d_ff={cfg.moe_intermediate_size}; {layers} MoE layer(s)"
    )
    console.print(
        f"[bold]{gpu.name}[/], {fmt.name} weights (b_w = {fmt.bytes_per_weight:g} B, {fmt.compute_dtype} GEMMs): "
        f"{gpu.bandwidth_tb_s:g} TB/s, {gpu.dense_tflops[fmt.compute_dtype]:,.1f} TFLOP/s dense, "
        f"ridge I* = {report.ridge_intensity:,.1f} FLOP/B"
    )
    console.print(f"routing: {report.routing}")
    console.print(
        f"B½ = {report.half_batch:.1f}   B95 = {report.batch_95:.1f}   ridge batch = {report.ridge_batch:,.0f}   "
        f"I(1) = {report.intensity_at_batch_one:.3g}   slope once all experts are touched = "
        f"{report.asymptotic_slope:.4g} FLOP/B per token"
    )
    console.print(_sweep_table(report))
    console.print(_step_table(report))
    if report.bills is not None:
        console.print(_params_table(report))
        console.print(_memory_table(report))
        fit = report.bills.fit
        verdict = "fits" if fit.fits else "does not fit"
        console.print(
            f"{fmt.name} on {fit.num_gpus}x {gpu.name} at utilisation {fit.utilization:g} minus a "
            f"{fit.reserve_gib:g} GiB reserve: {fit.usable_gib:.2f} GiB usable per GPU for weights + KV; "
            f"weights {fit.weights_gib:.2f} GiB per GPU -> {verdict} (headroom {fit.headroom_gib:.2f} GiB); "
            f"needs >= {fit.min_gpus} GPU(s)"
        )
    console.print(f"[dim]GPU figures: {gpu.source}[/]")


def _sweep_table(report: Report) -> Table:
    t = Table(title=f"One MoE layer (routed experts), {'uniform' if report.inclusion is None else 'measured'} routing")
    for col in ("batch", "experts touched", "% of E", "GFLOP", "weight GB", "FLOP/B", "floor µs", "bound"):
        t.add_column(col, justify="right")
    for row in report.rows:
        c = row.cost
        t.add_row(
            f"{c.batch:,}", f"{c.experts_touched:.1f}", f"{100 * c.experts_touched / report.config.num_experts:.1f}",
            f"{c.flops / 1e9:,.2f}", f"{c.weight_bytes / GB:,.3f}", f"{c.intensity:,.2f}",
            f"{c.time_floor_s * 1e6:,.1f}", c.bound,
        )
    return t


def _step_table(report: Report) -> Table:
    t = Table(title="Decode step floors (ms) and padding factor (padded / real rows)",
              caption="routed: MoE layers' routed experts; model: plus all other matmul weights; "
                      "dense=act / dense=tot: a dense model of the active / total matmul parameters")
    for col in ("batch", "routed", "model", "dense=act", "dense=tot"):
        t.add_column(col, justify="right")
    for block in PADDING_BLOCKS:
        t.add_column(f"pad@{block}", justify="right")
    for row in report.rows:
        floors = (row.cost.step_time_floor_s, row.model_step_floor_s, row.dense_same_active_step_floor_s,
                  row.dense_same_total_step_floor_s)
        t.add_row(f"{row.cost.batch:,}", *("-" if s is None else f"{s * 1e3:,.4g}" for s in floors),
                  *(f"{row.padding[b]:.2f}" for b in PADDING_BLOCKS))
    return t


def _params_table(report: Report) -> Table:
    p = report.bills.params
    t = Table(title=f"Parameters ({_layers_in_words(p)})")
    t.add_column("part")
    t.add_column("params (B)", justify="right")
    if p.encoder is not None:  # the whole model, then its decoder (a decode step's stack) and its encoder
        t.add_column("decoder (B)", justify="right")
        t.add_column("encoder (B)", justify="right")
    for name, field in PARTS:
        if field in ("second_blocks", "attention_experts", "cross_kv") and not getattr(p, field):
            continue  # ERNIE-4.5-VL's vision blocks, JetMoE's attention experts, a decoder's cross k / v: where held
        t.add_row(name, *_columns(p, field))
    e = p.encoder
    for name, whole, decoder, encoder in (("total", p.total, p.step_total, e and e.total),
                                          ("active, embedding included", p.active, p.active, e and e.active),
                                          ("active matmul (no embedding, norms)", p.active_matmul, p.active_matmul,
                                           e and e.active_matmul)):
        t.add_row(name, *(f"{n / 1e9:,.3f}" for n in ((whole, decoder, encoder) if e else (whole,))))
    t.caption = _caption(report)
    return t


# the bill's parts as the table names them, in its order
PARTS = (("embedding", "embedding"), ("output head", "output"), ("attention", "attention"),
         ("attention experts (MoA)", "attention_experts"), ("cross-attention k, v (once per prompt)", "cross_kv"),
         ("dense MLP", "dense_mlp"),
         ("routed experts", "routed_experts"), ("shared experts", "shared_experts"), ("router", "router"),
         ("second sparse blocks (vision)", "second_blocks"), ("norms", "norms"))


def _columns(p, field: str) -> list[str]:
    """One part's cells: the whole model's, and an encoder-decoder's decoder and encoder."""
    own = getattr(p, field)
    if p.encoder is None:
        return [f"{own / 1e9:,.3f}"]
    encoder = getattr(p.encoder, field)
    return [f"{n / 1e9:,.3f}" for n in (own + encoder, own, encoder)]


def _layers_in_words(p) -> str:
    layers = f"{p.num_dense_layers} dense + {p.num_moe_layers} MoE layers"
    if p.encoder is None:
        return layers
    return f"decoder {layers}; encoder {p.encoder.num_dense_layers} dense + {p.encoder.num_moe_layers} MoE layers"


def _caption(report: Report) -> str:
    p = report.bills.params
    caption = ("counted to the parameter (this family's bill equals transformers' model)" if p.exact else
               "approximate: this family's own attention is counted as grouped-query or MLA attention (within "
               "0.1-1% of transformers' model for its families)" if report.note is None else
               "approximate: the experts, shared experts and router as this family's model holds them, its attention "
               "as grouped-query attention (Gemma-4 with experts: 0.5% under its model)")
    if p.encoder is not None:
        caption += ("; a decode step runs the decoder, its cross-attention reading the encoder's output (keys and "
                    "values projected once per prompt): active counts a decode step's token, the encoder column's "
                    "an encoder token's (once per prompt)")
    if p.attention_experts:
        caption += "; active attention: k of the E attention experts a token"
    return caption


def _memory_table(report: Report) -> Table:
    t = Table(title="Weight memory (matmul weights in the format; embedding, head, router, norms in bf16)")
    for col in ("dtype", "total GB", "total GiB", "routed experts GB"):
        t.add_column(col, justify="right")
    for name, m in report.bills.memory.items():
        t.add_row(name, f"{m.total_gb:,.2f}", f"{m.total_gib:,.2f}", f"{m.routed_expert_gb:,.2f}")
    return t


def print_measurement(m: Measurement, console: Console) -> None:
    console.print(_measured_times_table(m))
    routing = Table(title="Measured routing vs predicted",
                    caption="touched: predicted for uniform routing and for this router's measured load; "
                            "pad: padded / real rows at block 16 and 128")
    for col in ("batch", "touched", "uniform", "load", "pad16", "pred", "pad128", "pred"):
        routing.add_column(col, justify="right", no_wrap=True)
    for r in m.rows:
        routing.add_row(
            f"{r.batch:,}", f"{r.experts_touched}", f"{r.predicted_experts_touched:.1f}",
            f"{r.skew_experts_touched:.1f}", f"{r.padding[16]:.3g}", f"{r.predicted_padding[16]:.3g}",
            f"{r.padding[128]:.3g}", f"{r.predicted_padding[128]:.3g}",
        )
    console.print(routing)
    for r in m.rows:
        if isinstance(r.graph_s, str):
            console.print(f"[yellow]graph capture failed at B={r.batch:,}: {r.graph_s}[/]")
    console.print(f"[dim]{m.note}. Ceilings {m.ceilings.source}: {m.ceilings.bandwidth_tb_s * 1e3:,.1f} GB/s, "
                  f"{next(iter(m.ceilings.dense_tflops.values())):,.2f} TFLOP/s.[/]")


def _measured_times_table(m: Measurement) -> Table:
    """One row per batch: graph replay, eager and host times beside the floor, and the issue's verdict."""
    times = Table(title=f"Measured: one layer on {m.device}, {m.backend} backend, {m.dtype}, "
                        f"K={m.hidden_size}, N={m.moe_intermediate_size}",
                  caption=f"graph: CUDA-graph replay (-: none on the CPU; failed: see below); eager: back-to-back "
                          f"forwards, one sync; host: issue time per forward (rest: the calls after each loop's "
                          f"first); ±: eager passes' interquartile range / median; floor: byte model on this "
                          f"device's ceilings, measured in this run; ok: the targets, judged for B <= "
                          f"{MEMORY_BOUND_MAX_BATCH}: host rest <= {HOST_TARGET_S * 1e6:.0f} µs, graph <= "
                          f"{GRAPH_FLOOR_TARGET} x floor",
                  caption_justify="left")
    for col in ("batch", "graph", "eager", "host", "rest", "±", "floor", "graph/floor", "eager/floor", "host ok",
                "graph ok"):
        times.add_column(col, justify="right", no_wrap=True)
    for r in m.rows:
        graph = "-" if r.graph_s is None else "failed" if isinstance(r.graph_s, str) else _seconds(r.graph_s)
        ratio = "-" if r.graph_over_floor is None else f"{r.graph_over_floor:.3g}"
        verdicts = {None: "", True: "met", False: "MISSED"}
        spread = f"{r.spread_pct:.0f}%" + (" noisy" if r.noisy else "")
        rest = "-" if r.host_rest_s is None else _seconds(r.host_rest_s)
        times.add_row(f"{r.batch:,}", graph, _seconds(r.eager_s), _seconds(r.host_s), rest, spread,
                      _seconds(r.predicted_time_s), ratio, f"{r.eager_over_floor:.3g}", verdicts[r.host_within_target],
                      verdicts[r.graph_within_target])
    return times


def _seconds(s: float) -> str:
    """A duration in the unit that keeps it short: 3.2 s, 41.5 ms, 870 µs."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"
