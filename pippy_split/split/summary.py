"""Human-readable views of a Pipe: plain text, rich tables, HTML for notebooks."""

from __future__ import annotations

import io
from typing import Any, Protocol, Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .balance import TARGET_RATIO
from .spec import Edge
from .stage_graph import StageInfo

__all__ = ["pipe_text", "pipe_rich", "pipe_html", "imbalance_warning", "stage_shares"]


class _DrawnPipe(Protocol):
    """What the views read of a :class:`~pippy_split.split.pipe.Pipe` (which imports this
    module to draw itself, so it is named here by what it holds)."""

    @property
    def stages(self) -> Sequence[StageInfo]: ...

    @property
    def edges(self) -> Sequence[Edge]: ...

    @property
    def shared_parameters(self) -> dict: ...

    @property
    def model_name(self) -> str: ...

    @property
    def balance(self) -> Any: ...

    @property
    def num_stages(self) -> int: ...


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def _module_range(mods: list[str]) -> str:
    mods = [m for m in mods if m]
    if not mods:
        return "(top-level ops)"
    return mods[0] if len(mods) == 1 else f"{mods[0]} … {mods[-1]} ({len(mods)})"


def imbalance_warning(pipe: _DrawnPipe) -> str | None:
    """A warning when the split is uneven under the cost model it was made with.

    An int split (``pipeline(model, N, balance=...)``) is judged as the balancer judged
    it: its costliest stage over ``TARGET_RATIO`` x an even one, by its metric. Split
    points given by the user are judged by FLOPs (or the pipe's metric): the costliest
    stage over 1.5x the cheapest.

    Example:
        >>> import torch, pippy_split as ps
        >>> from pippy_split import zoo
        >>> model = zoo.get("mlp_stack", d=8, n_layer=4).model; x = torch.randn(2, 8)  # 4 equal layers
        >>> imbalance_warning(ps.pipeline(model, ["layers.3"], (x,)))
        'imbalanced: stage 0 costs 3.0x stage 1 (flops); consider moving split points'
        >>> imbalance_warning(ps.pipeline(model, ["layers.2"], (x,))) is None
        True
    """
    report = getattr(pipe, "balance", None)
    metric, shares = stage_shares(pipe)
    if len(shares) < 2:
        return None
    if report is not None and report.best_ratio is not None and len(report.stage_costs) == pipe.num_stages:
        if report.ratio <= TARGET_RATIO:
            return None
        hi = shares.index(max(shares))
        return (f"imbalanced: stage {hi} costs {report.ratio:.2f}x an even stage ({metric}); the best any cuts "
                f"can do is {report.best_ratio:.2f}x")
    if min(shares) <= 0:
        return None
    ratio = max(shares) / min(shares)
    if ratio > 1.5:
        hi, lo = shares.index(max(shares)), shares.index(min(shares))
        return f"imbalanced: stage {hi} costs {ratio:.1f}x stage {lo} ({metric}); consider moving split points"
    return None


def stage_shares(pipe: _DrawnPipe) -> tuple[str, list[float]]:
    """``(metric, each stage's fraction of the total cost)``: under the pipe's balance
    metric (``pipeline(balance=...)``), else by FLOPs.

    Example:
        >>> import torch, pippy_split as ps
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> metric, shares = stage_shares(ps.pipeline(model, 2, (torch.randn(2, 4),)))  # FLOPs 64 + 8 | 64
        >>> metric, [round(s, 2) for s in shares]
        ('flops', [0.53, 0.47])
    """
    report = getattr(pipe, "balance", None)
    if report is not None and report.total > 0 and len(report.stage_costs) == pipe.num_stages:
        return report.metric, list(report.shares)
    flops = [st.flops for st in pipe.stages]
    total = sum(flops)
    return "flops", [f / total if total else 0.0 for f in flops]


def _peers(pipe: _DrawnPipe, s: int) -> tuple[str, str]:
    recv = sorted({("in" if e.from_input else str(e.src_stage)) + ("*" if e.is_skip else "") for e in pipe.edges if e.dst_stage == s})
    send = sorted({str(e.dst_stage) + ("*" if e.is_skip else "") for e in pipe.edges if e.src_stage == s})
    return ", ".join(recv) or "-", ", ".join(send) or "-"


def pipe_rich(pipe: _DrawnPipe) -> Group:
    """Stages table, edges table and warnings as a rich renderable."""
    plural = "" if pipe.num_stages == 1 else "s"
    stages = Table(title=f"Pipe of {pipe.model_name}: {pipe.num_stages} stage{plural}", title_justify="left")
    metric, shares = stage_shares(pipe)
    share_col = f"{metric} share"
    for col in ("stage", "modules", "params", "bytes", "FLOPs/mb", share_col, "receives from", "sends to"):
        stages.add_column(col, justify="right" if col in ("params", "bytes", "FLOPs/mb", share_col) else "left")
    for st, share in zip(pipe.stages, shares):
        recv, send = _peers(pipe, st.index)
        stages.add_row(str(st.index), _module_range(st.modules), _human(st.num_params), _human(st.param_bytes) + "B",
                       _human(st.flops), f"{share:.0%}", recv, send)
    if pipe.num_stages > 1 and max(shares) > 0:
        stages.caption = (f"costliest stage: {max(shares) * pipe.num_stages:.2f}x an even one "
                          f"(total / {pipe.num_stages}) by {metric}")
        stages.caption_justify = "left"
    edges = Table(title="Edges (* = skip over at least one stage)", title_justify="left")
    for col in ("from", "to", "value", "shape", "dtype", "grad"):
        edges.add_column(col)
    for e in pipe.edges:
        src = "input" if e.from_input else f"stage {e.src_stage}[{e.src_output}]"
        style = "bold yellow" if e.is_skip else None
        edges.add_row(src, f"stage {e.dst_stage}[{e.dst_input}]" + (" *" if e.is_skip else ""), e.display_name,
                      "(" + ", ".join(str(d) for d in e.spec.shape) + ")", str(e.spec.dtype).replace("torch.", ""),
                      "yes" if e.spec.carries_grad else "no", style=style)
    parts: list[Any] = [stages, edges]
    if pipe.shared_parameters:
        shared = Table(title="Shared parameters (gradients summed across stages)", title_justify="left")
        shared.add_column("parameter")
        shared.add_column("held by")
        for fqn, holders in pipe.shared_parameters.items():
            shared.add_row(fqn, "; ".join(f"stage {s}: {', '.join(n)}" for s, n in holders))
        parts.append(shared)
    warning = imbalance_warning(pipe)
    if warning:
        parts.append(Text("warning: " + warning, style="bold red"))
    return Group(*parts)


def _render(pipe: _DrawnPipe, **console_kw) -> Console:
    # force_jupyter=False: inside a notebook rich would otherwise display the table
    # itself (ignoring file=) every time a repr is asked for, on top of the one view
    # IPython shows from the returned string.
    console_kw.setdefault("file", io.StringIO())
    console = Console(width=120, force_jupyter=False, **console_kw)
    console.print(pipe_rich(pipe))
    return console


def pipe_text(pipe: _DrawnPipe) -> str:
    buffer = io.StringIO()
    _render(pipe, file=buffer, color_system=None)
    return buffer.getvalue().rstrip()


_HTML_FRAGMENT = (
    '<pre style="white-space: pre; overflow-x: auto; line-height: normal; '
    "font-family: Menlo, 'DejaVu Sans Mono', consolas, 'Courier New', monospace\">"
    "<code>{code}</code></pre>"
)


def pipe_html(pipe: _DrawnPipe) -> str:
    """The tables as one ``<pre>`` fragment for a notebook cell (not a whole HTML page)."""
    console = _render(pipe, record=True)
    return console.export_html(inline_styles=True, code_format=_HTML_FRAGMENT)
