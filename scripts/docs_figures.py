"""The documentation's figures, drawn from the measurements in bench/results (`make docs-figures`).

Each PNG carries the sha256 of the results file it was drawn from (a PNG text field, "Source"), so
tests/test_docs_figures.py can tell a figure drawn from older figures than the file now holds.

    python scripts/docs_figures.py [--out docs/figures]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def source_tag(data: Path) -> str:
    """What a figure records of the file it was drawn from."""
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    return f"{data.relative_to(ROOT)} sha256:{digest}"


def accuracy_vs_budget(data: dict, out: Path, tag: str) -> None:
    """Each method's accuracy against the share of visual KV its packs held (as measured: a
    token budget is a share of this world's clips too), a panel per protocol."""
    import matplotlib.pyplot as plt

    from mmkv_cli.study.evaluate import share_axis

    protocols = list(dict.fromkeys(run["protocol"] for run in data["runs"]))
    fig, axes = plt.subplots(1, len(protocols), figsize=(5 * len(protocols) + 2, 4), squeeze=False)
    methods = list(dict.fromkeys(run["method"] for run in data["runs"]))
    for ax, protocol in zip(axes[0], protocols):
        runs = [run for run in data["runs"] if run["protocol"] == protocol]
        for i, method in enumerate(methods):
            points = sorted((r["kept"], r["accuracy"]) for r in runs if r["method"] == method)
            style = {"color": plt.get_cmap("tab20")(i % 20), "label": method, "marker": "os"[i % 2]}
            if points and all(kept >= 1.0 for kept, _ in points):  # keeps all: a level
                ax.axhline(points[0][1], linestyle=":", color=style["color"], label=method)
            elif points:
                ax.plot(*zip(*points), **style)
        share_axis(ax)
        ax.set_title(f"{protocol} protocol", fontsize=10)
        ax.set_xlabel("share of visual KV kept (measured)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("accuracy")
    shown = {}  # one legend for both panels, a method once
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            shown.setdefault(label, handle)
    axes[0][-1].legend(
        shown.values(),
        shown.keys(),
        fontsize="small",
        loc="center left",
        bbox_to_anchor=(1.02, 0.5),
    )
    args = data["args"]
    fig.suptitle(
        f"mmkv eval: {args['model']} on {args['clips']} clips of {args['frames']} frames, "
        f"budgets {args['budgets'].replace(',', ', ')} (a dotted line: a method keeping all)",
        fontsize=10,
    )
    _save(fig, out, tag, plt)


def cost_vs_length(data: dict, out: Path, tag: str) -> None:
    """TTFT and pack size against the video's length, a line per method."""
    import matplotlib.pyplot as plt

    fig, (ttft, size) = plt.subplots(1, 2, figsize=(9, 3.6))
    methods = dict.fromkeys(row["method"] for row in data["rows"])
    for i, method in enumerate(methods):
        rows = sorted((r for r in data["rows"] if r["method"] == method), key=lambda r: r["frames"])
        frames = [r["frames"] for r in rows]
        style = {"marker": "o", "color": f"C{i % 10}", "label": method}
        ttft.plot(frames, [r["ttft_s"] for r in rows], **style)
        size.plot(frames, [r["bytes"] / 2**20 for r in rows], **style)
    for ax, what in ((ttft, "time to first token (s)"), (size, "pack size (MiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("frames (196 visual tokens each)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, which="both")
    size.legend(fontsize="small")
    fig.suptitle(f"{data['model']}, {data['layers']} layer(s), on a CPU", fontsize=10)
    _save(fig, out, tag, plt)


def live_over_an_hour(data: dict, out: Path, tag: str) -> None:
    """A live stream followed for an hour: the encode's seconds for each minute of stream (under
    60 it keeps up) and the time to first token of a question asked at each minute."""
    import matplotlib.pyplot as plt

    fig, (encode, ttft) = plt.subplots(1, 2, figsize=(9, 3.6))
    for i, run in enumerate(data["runs"]):
        minutes = range(1, len(run["encode_s_per_minute"]) + 1)
        style = {"color": f"C{i % 10}", "label": run["method"]}
        encode.plot(minutes, run["encode_s_per_minute"], **style)
        ttft.plot(range(1, len(run["asks"]) + 1), [a["ttft_s"] for a in run["asks"]], **style)
    encode.axhline(60, color="gray", linestyle="--", label="real time")
    encode.set_ylim(0, 66)
    encode.set_ylabel("encode seconds per minute of stream")
    ttft.set_ylim(bottom=0)
    ttft.set_ylabel("a question's time to first token (s)")
    for ax in (encode, ttft):
        ax.set_xlabel("minute of the stream")
        ax.grid(alpha=0.3)
    encode.legend(fontsize="small")
    args = data["args"]
    fig.suptitle(
        f"mmkv live: {args['model']}, {args['layers']} layer(s), {args['tokens']} tokens of "
        f"memory, {args['fps']:g} fps, on {args['device']}",
        fontsize=10,
    )
    _save(fig, out, tag, plt)


def _save(fig, out: Path, tag: str, plt) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Source": tag})
    plt.close(fig)


Figure = Callable[[dict, Path, str], None]
# the figure's file, the results file it is drawn from, and how
FIGURES: dict[str, tuple[str, Figure]] = {
    "accuracy-demo.png": ("eval-demo-64.json", accuracy_vs_budget),
    "cost-vs-length-cpu.png": ("scale-cpu.json", cost_vs_length),
    "live-hour-cpu.png": ("live-rehearsal-llava-ov-0.5b-1l.json", live_over_an_hour),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (results, draw) in FIGURES.items():
        data = RESULTS / results
        draw(json.loads(data.read_text()), args.out / name, source_tag(data))
        print(f"wrote {args.out / name} from {data.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
