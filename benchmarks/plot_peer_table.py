"""Draw te_jax against its best peer, row by row, from the markdown tables a peer benchmark prints
(attention_masks_gpu, attention_head_dims_gpu and decode_gpu: `| row | [fwd|fb |] name value | ... |`).

    PYTHONPATH=. python3 -m benchmarks.plot_peer_table LOG [LOG ...] --out PNG [--title TEXT]

Each `## ...` section of a log that holds such a table becomes one panel: for every row (and pass), te_jax's value
(the `te_jax` cell: what auto gives a user) over the best peer's (cells whose name does not start with `te_jax`),
with a line at 1.0. Rows of later logs replace rows of the same name and pass in earlier ones, so a run split over
several device calls draws as one table. Lines before the first `## ` heading (per-row progress) are ignored.
"""
from __future__ import annotations

import argparse
import re

_CELL = re.compile(r"^(?P<name>[A-Za-z][\w\-./ ]*?) (?P<value>[0-9]+(?:\.[0-9]+)?)$")
OURS = "te_jax"
CAP = 1.5  # the longest bar drawn (ratio); larger ratios are labelled


def read_tables(path: str) -> list[tuple[str, dict]]:
    """[(section title, {(row, pass): {implementation: value}})] for each `## ` section that holds a table."""
    sections, title, rows = [], None, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("## "):
                if rows:
                    sections.append((title, rows))
                title, rows = line[3:].strip(), {}
                continue
            if rows is None or not line.startswith("| ") or line.startswith("|---") or line.startswith("| row "):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            label, rest = cells[0], cells[1:]
            which = ""
            if rest and rest[0] in ("fwd", "fb"):
                which, rest = rest[0], rest[1:]
            values = {}
            for cell in rest:
                m = _CELL.match(cell)
                if m and " of " not in cell:
                    values[m["name"]] = float(m["value"])
            if values:
                rows[(label, which)] = values
    if rows:
        sections.append((title, rows))
    return sections


def ratios(rows: dict) -> list[tuple[str, float, str]]:
    """[(row label with its pass, te_jax / best peer, best peer's name)] for the rows with te_jax and a peer."""
    out = []
    for (label, which), values in rows.items():
        peers = {n: v for n, v in values.items() if not n.startswith("te_jax")}
        if OURS in values and peers:
            best = max(peers, key=peers.get)
            name = f"{label} ({'fwd+bwd' if which == 'fb' else which})" if which else label
            out.append((name, values[OURS] / peers[best], best))
    return out


def merged(paths) -> list[tuple[str, dict]]:
    """Sections by position across the logs (the first log's titles), later logs' rows replacing earlier ones."""
    result = []
    for path in paths:
        for i, (title, rows) in enumerate(read_tables(path)):
            if i < len(result):
                result[i][1].update(rows)
            else:
                result.append((title, dict(rows)))
    return result


def plot(paths, out: str, title: str = "") -> str:
    """Write the PNG; returns out, or a sentence saying why not (matplotlib missing, no table)."""
    sections = [(t, ratios(rows)) for t, rows in merged(paths)]
    sections = [(t, r) for t, r in sections if r]
    if not sections:
        return "no table with te_jax and a peer in " + ", ".join(paths)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no plot"
    height = max(3.0, 0.32 * max(len(r) for _, r in sections) + 1.5)
    fig, axes = plt.subplots(1, len(sections), figsize=(7.5 * len(sections), height), squeeze=False)
    for ax, (sub, rs) in zip(axes[0], sections):
        names = [n for n, _, _ in rs][::-1]
        vals = [v for _, v, _ in rs][::-1]
        peers = [p for _, _, p in rs][::-1]
        shown = [min(v, CAP) for v in vals]  # bars past CAP are cut there; the label gives the value
        ax.barh(names, shown, color=["tab:green" if v >= 1.0 else "tab:red" for v in vals])
        ax.axvline(1.0, color="black", lw=1)
        for y, (v, p) in enumerate(zip(vals, peers)):
            ax.text(min(v, CAP), y, f" {v:.3f} of {p}" + (" (bar cut)" if v > CAP else ""), va="center", fontsize=7)
        ax.set_xlim(0, CAP + 0.75)
        ax.set_xlabel(f"te_jax / best peer (bars cut at {CAP})")
        ax.set_title(sub, fontsize=8, wrap=True)
        ax.tick_params(axis="y", labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95) if title else None)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    print(plot(a.logs, a.out, a.title))


if __name__ == "__main__":
    main()
