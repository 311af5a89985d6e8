"""The report as tables: rich on a terminal, GitHub Markdown for a README."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedchat.bench.capacity import CHAT_TOKENS
from pagedchat.bench.report import PAGEDCHAT, Report
from pagedchat.bench.stats import RunStats, ratio


def ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:,.0f}"


def rate(r: float | None) -> str:
    return "-" if r is None else f"{r:,.1f}"


def times(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}".replace(".0 ", " ")
    return f"{n:,.0f} B"


@dataclass(frozen=True)
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    groups: list[int] = field(default_factory=list)  # row indexes that start a new group
    left: int = 1                                     # leading columns aligned left


def header_lines(report: Report) -> list[str]:
    m, w, cfg = report.machine, report.workload, report.config
    lines = [f"pagedchat bench · {report.model.path} ({report.model.dtype}) on {m.device} "
             f"({m.cpu}, {m.cpus or '?'} CPUs, {m.torch_threads} torch threads, torch {m.torch}"
             f"{f', its kernels {m.torch_level}' if m.torch_level else ''}) · "
             f"system prompt {w.system_tokens} tokens, {w.max_tokens} tokens per reply"]
    if m.cpu_level:
        lines.append(f"this CPU's best level: {m.cpu_level}")
    if report.model.kernels:
        lines.append(f"weights {report.model.weights}; projections: {report.model.kernels}")
    if report.model.attention:
        lines.append(f"attention: {report.model.attention}")
    lines += report.peer_builds
    lines += bandwidth_lines(report)
    alternating = [PAGEDCHAT] + [p.label for lv in report.levels[:1] for p in lv.peers if p.every_round]
    if cfg.repeat > 1:
        lines.append(f"{cfg.repeat} rounds per level of {', '.join(alternating)}, alternating; each runner's "
                     "median round is shown")
    if m.load_average_at_start:
        end = (m.load_average_at_end or ("?",))[0]
        lines.append(f"load average {m.load_average_at_start[0]} at the start, {end} at the end "
                     "(other work on the machine slows every runner alike)")
    return lines


def bandwidth_lines(report: Report) -> list[str]:
    """The measured read bandwidth, and the share of it each runner's one-chat decode reaches."""
    bw = report.machine.read_bandwidth
    if not bw:
        return []
    from pagedchat.bench.bandwidth import READ_MIB

    how = f"a {size(READ_MIB * 2**20)} torch.sum on every core, best of 5"
    torch_bw = report.machine.read_bandwidth_torch
    if torch_bw is not None:  # the shares are of the huge pages' figure: pagedchat's weights sit in them
        how = f"in huge pages, as pagedchat's weights are; {torch_bw / 2**30:,.1f} in torch's own memory; {how}"
    line = f"memory read bandwidth {bw / 2**30:,.1f} GiB/s at the start ({how})"
    around = report.round_bandwidths()
    if around:
        line += f"; {min(around) / 2**30:,.1f}-{max(around) / 2**30:,.1f} GiB/s around the one-chat rounds"
    shares = report.bandwidth_shares()
    if shares:
        line += (f"; one chat's decode reads the weights ({size(report.weights.weight_bytes)} a token) at "
                 + ", ".join(f"{100 * s:.0f}% ({label})" for label, s in shares)
                 + " of the bandwidth measured just before and after each of its rounds (median)")
    return [line]


def _token_cost(report: Report) -> Section:
    c = report.token_cost
    return Section("1. What one token costs", ["source", "KV bytes per token"], [
        [f"model shape: 2 x {c.num_layers} layers x {c.num_kv_heads} kv heads x {_row(c)} ({c.dtype} pages)",
         f"{c.bytes_per_token_model:,}"],
        [f"allocated pool: {c.pool_bytes:,} B / ({c.num_pages:,} pages x {c.block_size} slots)",
         f"{c.bytes_per_token_pool:,.0f}"],
    ])


def _row(c) -> str:
    """One (token, KV head) row in words: an int8 row's scale follows its codes."""
    if c.dtype == "int8":
        return f"({c.head_dim} head dim x 1 B + a 4 B scale)"
    return f"{c.head_dim} head dim x {c.dtype_bytes} B"


def _page_dtypes(report: Report) -> list[Section]:
    if not report.page_dtypes:
        return []
    cost, base = report.token_cost, report.page_dtypes[0]
    rows = [[f"{d.dtype}{' (this run)' if d.dtype == cost.dtype else ''}", f"{d.bytes_per_token:,}",
             f"{d.num_pages:,}", f"{d.chats:,}", f"{d.chats / base.chats:.2f}x" if base.chats else "-"]
            for d in report.page_dtypes]
    return [Section(f"   Page dtypes (--kv-cache-dtype): chats of {CHAT_TOKENS:,} tokens, nothing shared, in the "
                    f"same {size(cost.pool_bytes)} KV budget", ["pages' dtype", "KV bytes per token", "pages",
                                                                f"{CHAT_TOKENS:,}-token chats", "vs float32"],
                    rows)]


def _capacity(report: Report) -> list[Section]:
    cost, cap = report.token_cost, report.capacity
    ps, p, c = cap.paged_shared, cap.paged, cap.contiguous
    schemes = Section(
        f"2. Capacity: chats of {cap.chat_tokens} tokens in a {size(cost.pool_bytes)} KV budget "
        f"({cost.token_slots:,} token slots)",
        ["scheme", "slots reserved per chat", "chats that fit", "wasted slots per chat"], [
            [f"paged, system prompt shared ({ps.shared_slots} slots once)", f"{ps.slots_per_chat:,}",
             f"{ps.chats:,}" if ps.chats is not None else "-", f"{ps.waste_slots_per_chat:,}"],
            [f"paged, {cost.block_size}-token pages, nothing shared", f"{p.slots_per_chat:,}", f"{p.chats:,}",
             f"{p.waste_slots_per_chat:,}"],
            [f"contiguous, full context ({cost.max_context:,})", f"{c.slots_per_chat:,}", f"{c.chats:,}",
             f"{c.waste_slots_per_chat:,}"],
        ])
    w = report.weights
    free = "this GPU's free memory" if w.gpu_free_measured else "the same budget as free memory"
    extra = [f"{w.fixed_extra_tokens:+,} ({pct(w.fixed_extra_tokens, w.fixed_bf16.tokens)})",
             f"{w.gpu_extra_tokens:+,} ({pct(w.gpu_extra_tokens, w.gpu_bf16.tokens)})"]
    weights = Section(
        f"   Weights beside the KV pool: {w.parameters:,} parameters in {size(w.weight_bytes)} as loaded "
        f"({report.model.dtype}; bf16 would take {size(w.bf16_weight_bytes)}), KV pool {size(w.kv_pool_bytes)}",
        ["memory rule", "KV tokens with these weights", "with bf16 weights", "these weights fit"], [
            [f"fixed budget {size(w.budget_bytes)} (bf16 weights + this pool) minus the weights",
             f"{w.fixed_loaded.tokens:,}", f"{w.fixed_bf16.tokens:,}", extra[0]],
            [f"GPU rule: 60% of ({size(w.gpu_free_bytes)}, {free}, minus the weights)",
             f"{w.gpu_loaded.tokens:,}", f"{w.gpu_bf16.tokens:,}", extra[1]],
        ])
    return [schemes, *_page_dtypes(report), weights]


def _waste(report: Report) -> Section:
    rows = []
    for lv in report.levels:
        m = lv.memory_at_peak
        held = f"{m.tokens_held:,}"
        if m.unique_tokens_held != m.tokens_held:
            held += f" ({m.unique_tokens_held:,} distinct)"
        rows.append([str(lv.chats), held, f"{m.paged_slots:,}",
                     f"{m.paged_waste_slots:,} ({pct(m.paged_waste_slots, m.paged_slots)})",
                     f"{m.contiguous_slots:,}",
                     f"{m.contiguous_waste_slots:,} ({pct(m.contiguous_waste_slots, m.contiguous_slots)})"])
    return Section("   Waste measured at the run's peak (allocated but unused slots)",
                   ["chats", "tokens held", "paged slots", "paged waste", "contiguous slots", "contiguous waste"],
                   rows, left=0)


def _sharing(report: Report) -> Section:
    rows = []
    for lv in report.levels:
        sh = lv.sharing
        rows.append([str(lv.chats), f"{sh.pages_with:,}", f"{sh.pages_without:,}",
                     f"{sh.pages_saved:,} ({pct(sh.pages_saved, sh.pages_without)})",
                     f"{sh.prompt_tokens:,}", f"{sh.prefill_tokens_computed:,}",
                     f"{sh.prefill_tokens_saved:,} ({pct(sh.prefill_tokens_saved, sh.prompt_tokens)})"])
    return Section(f"3. Sharing one {report.workload.system_tokens}-token system prompt (pages at the peak; "
                   "'without' = each chat's own pages, computed)",
                   ["chats", "pages with sharing", "pages without", "saved", "prompt tokens", "prefilled",
                    "prefill saved"], rows, left=0)


def _speed(report: Report) -> Section:
    against = bool(report.peer_labels)
    cols = ["chats", "runner", "end-to-end tok/s", "decode tok/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"]
    if against:
        cols += ["pagedchat is", "decode: pagedchat is"]
    rows, groups = [], []

    def row(n: str, name: str, st: RunStats, ratios: tuple[float | None, float | None] | None) -> None:
        cells = [n, name, rate(st.end_to_end_tokens_per_s), rate(st.decode_tokens_per_s),
                 ms(st.ttft_p50_s), ms(st.ttft_p95_s), ms(st.itl_p50_s), ms(st.itl_p95_s)]
        if against:
            cells += [times(r) for r in ratios] if ratios else ["", ""]
        rows.append(cells)

    for lv in report.levels:
        groups.append(len(rows))
        row(str(lv.chats), PAGEDCHAT, lv.engine, None)
        for p in lv.peers:
            row("", p.label, p.stats, (p.end_to_end_ratio, p.decode_ratio))
    return Section("4. Speed (tokens/s over all chats together; latencies in ms)", cols, rows,
                   groups if against else [], left=2)


def _first_token(report: Report) -> Section:
    w = report.ttft_cold_warm
    rows = [["pagedchat, cold (never seen)", ms(w.cold_s), "0", ""],
            ["pagedchat, warm (cached)", ms(w.warm_s), f"{w.warm_cached_tokens:,}", f"{w.warm_over_cold:.2f}x cold"]]
    ours = report.cold_first_token[0].median_s
    for t in report.cold_first_token[1:]:
        rows.append([f"{t.label}, cold", ms(t.median_s), "0",
                     f"pagedchat's cold is {times(ratio(t.median_s, ours))} as fast"])
    return Section(f"   First token of a new chat alone ({w.prompt_tokens} prompt tokens, median of {w.repeats})",
                   ["runner, system prompt", "TTFT ms", "prompt tokens from cache", ""], rows)


def _startup(report: Report) -> Section:
    rows = [[t.label, f"{t.median_s:.2f}", ", ".join(f"{s:.2f}" for s in t.all_s)] for t in report.startup]
    return Section("5. Start to model ready, model cached (a fresh process: imports, load, KV cache)",
                   ["runner", "seconds (median)", "every round"], rows)


def sections(report: Report) -> list[Section]:
    out = [_token_cost(report), *_capacity(report), _waste(report), _sharing(report), _speed(report),
           _first_token(report)]
    if report.startup:
        out.append(_startup(report))
    return out


FOOTNOTE = ("TTFT counts from the moment all chats are submitted: one at a time, later chats wait for the earlier "
            "ones. ITL = time between a chat's consecutive tokens. 'pagedchat is' = pagedchat's end-to-end tok/s "
            "over that runner's; 'decode: pagedchat is' the same for decode tok/s.")


def render(report: Report, console) -> None:
    from rich.table import Table

    for line in header_lines(report):
        console.print(line, highlight=False, style=None if line.startswith("pagedchat") else "dim")
    for sec in sections(report):
        t = Table(title=sec.title, title_justify="left")
        for i, col in enumerate(sec.columns):
            t.add_column(col, justify="left" if i < sec.left else "right")
        for i, r in enumerate(sec.rows):
            if i in sec.groups and i:
                t.add_section()
            t.add_row(*r)
        console.print(t)
    if report.peer_labels:
        console.print(FOOTNOTE, style="dim", highlight=False)


def to_markdown(report: Report) -> str:
    """The same tables as GitHub Markdown, for a README."""
    lines = [line + "  " for line in header_lines(report)]
    for sec in sections(report):
        lines += ["", f"**{sec.title.strip()}**", "",
                  "| " + " | ".join(sec.columns) + " |",
                  "|" + "|".join(":---" if i < sec.left else "---:" for i in range(len(sec.columns))) + "|"]
        lines += ["| " + " | ".join(cell or " " for cell in r) + " |" for r in sec.rows]
    if report.peer_labels:
        lines += ["", FOOTNOTE]
    return "\n".join(lines) + "\n"
