"""The bench report for people: a text table and a throughput plot."""

from __future__ import annotations

from .timing import BenchError


def _fmt(r: dict) -> str:
    gb = f", {r['gbps']:.2f} GB/s" if "gbps" in r else ""
    return f"{r['p50_ms']:.3f} ms (min {r['min_ms']:.3f}, max {r['max_ms']:.3f}{gb})"


def format_report(report: dict) -> str:
    m = report["machine"]
    lines = [f"kvlend bench: {m['nproc']} CPUs, {m['memory_gib']} GiB, {m['cpu']}; "
             f"{report['reps']} reps after warm-up{' (--quick sizes)' if report['quick'] else ''}"]
    for key, s in report["scenarios"].items():
        lines.append(f"\nscenario {key}: {s['name']}")
        blocks = s.get("requests") or [s]
        for b in blocks:
            if "descriptors" in b and "tokens" in b:
                d = b["descriptors"]
                lines.append(f"  {b['tokens']} tokens x {b['layers']} layers, {b['bytes'] >> 20} MiB; descriptors: "
                             f"kvlend {d['kvlend']}, minimum {d['minimum']}, per page {d['per_page']}")
            elif "label" in b:
                lines.append(f"  {b['label']}")
            for name, r in b["results"].items():
                extra = "" if "verified" not in r else f"  verified={r['verified']}"
                if name == "staging":
                    extra += "  [" + ", ".join(f"{k} {v['p50_ms']:.2f} ms" for k, v in r["steps"].items()) + "]"
                if "p99_ms" in r and key == "3":
                    extra = f"  p99 {r['p99_ms']:.3f} ms" + extra
                if "cpu_us_per_request" in r:  # scenario 7: a point of the sweep
                    lines.append(f"    {name:22s} {r['cpu_us_per_request']:.0f} us CPU per request, "
                                 f"{r['requests_per_s']:.0f} requests/s{extra}")
                    continue
                if "seconds" in r:  # scenario 5: one timed run of every request
                    lines.append(f"    {name:22s} {r['seconds'] * 1e3:.1f} ms, {r['gbps']:.2f} GB/s, "
                                 f"{r['requests_per_s']:.0f} requests/s{extra}")
                    continue
                if "ms" in r:  # scenario 4: one sample
                    more = f", handshake {r['handshake_ms']:.1f} ms" if "handshake_ms" in r else ""
                    lines.append(f"    {name:22s} {r['ms']:.1f} ms{more}{extra}")
                    continue
                lines.append(f"    {name:22s} {_fmt(r)}{extra}")
            for name, r in b["results"].items():
                if r.get("breakdown"):
                    lines.append(f"    {name} p50 phases: " + ", ".join(
                        f"{k[4:-3]} {'-' if v is None else f'{v:.3f}'} ms" for k, v in r["breakdown"].items()))
            lines.append("    ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in b["ratios"].items()))
            lines.append("    targets: "
                         + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in b["targets"].items()))
            if b.get("aims"):
                lines.append("    aims: "
                             + ", ".join(f"{k}: {'met' if v else 'not yet'}" for k, v in b["aims"].items()))
        if "one_chunk_transfer_ms" in s:
            lines.append(f"  the off mode's whole transfer {s['transfer_ms_off']:.2f} ms, one chunk's about "
                         f"{s['one_chunk_transfer_ms']:.2f} ms; left after the last chunk with progressive lending "
                         f"(its tail less the off tail's round trips) {s['transfer_left_ms']:.2f} ms")
        for note in s.get("notes", []):
            lines.append(f"  note: {note}")
        if "path" in s:
            lines.append(f"  path: {s['path']}")
        if "baseline" in s:
            lines.append(f"  baseline: {s['baseline']}")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot, headless; checked before a run so a missing extra fails fast."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'kvlend[bench]'") from None
    return plt


_SERIES = {"kvlend": "kvlend", "raw_same_descriptors": "raw NIXL, kvlend's descriptors",
           "raw_nixl_notif": "raw NIXL, kvlend's descriptors, the target freeing blocks per notification",
           "raw_per_page": "raw NIXL, one descriptor per page",
           "raw_nixl_prepped": "raw NIXL, prepared page lists by index, the target freeing blocks per notification",
           "kvlend_node": "kvlend through the nodes",
           "kvlend_node_ahead": "kvlend through the nodes, reads ahead of the claim's answer",
           "kvlend_node_claimed_ahead": "kvlend through the nodes, claimed a request ahead",
           "kvlend_node_no_window": "kvlend through the nodes, no tcp read window",
           "staging": "host staging (gather + read + scatter)", "raw_nixl": "raw NIXL, one descriptor",
           "memcpy": "memcpy (same process)"}


def throughputs(report: dict) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """Request labels, smallest first, and per method its (request index, GB/s at p50).

    Scenario 3 (small fragmented requests) and 2 (model-shaped, fragmented) come
    first, by size; scenario 1's contiguous leases last.
    """
    blocks = []
    if "3" in report["scenarios"]:
        s3 = report["scenarios"]["3"]
        blocks.append((s3, f"{s3['pages']} pages x {s3['layers']} layer"))
    for b in report["scenarios"].get("2", {}).get("requests", []):
        blocks.append((b, f"{b['tokens'] // 1024}k tokens x {b['layers']} layers"))
    blocks.sort(key=lambda item: item[0]["bytes"])
    for b in report["scenarios"].get("1", {}).get("requests", []):
        blocks.append((b, "one contiguous lease"))
    labels: list[str] = []
    series: dict[str, list[tuple[int, float]]] = {}
    for i, (b, label) in enumerate(blocks):
        labels.append(f"{label}\n{b['bytes'] / 2**20:g} MiB")
        for method, r in b["results"].items():
            series.setdefault(_SERIES[method], []).append((i, b["bytes"] / r["p50_ms"] / 1e6))
    return labels, series


def plot(report: dict, path: str) -> None:
    """Throughput against request size for kvlend and the baselines (needs the ``bench`` extra: matplotlib)."""
    plt = pyplot()
    labels, series = throughputs(report)
    fig, ax = plt.subplots(figsize=(9, 5))
    contiguous = len(report["scenarios"].get("1", {}).get("requests", []))
    lone = range(len(labels) - contiguous, len(labels))  # the contiguous leases: points, not on the line
    for (name, points), marker in zip(series.items(), "osD^vPX"):
        on_line = [p for p in points if p[0] not in lone]
        (line,) = ax.plot([p[0] for p in on_line], [p[1] for p in on_line], marker=marker, label=name)
        ax.plot([p[0] for p in points if p[0] in lone], [p[1] for p in points if p[0] in lone], marker=marker,
                linestyle="none", color=line.get_color())
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("request (fragmented pools, except the contiguous lease)")
    ax.set_ylabel("GB/s at p50 (higher is better)")
    m = report["machine"]
    ax.set_title(f"kvlend bench{' --quick' if report['quick'] else ''}: throughput by request size; "
                 f"{m['nproc']} CPUs, NIXL over UCX (cma) on loopback", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
