"""Real Hugging Face architectures through the whole kit: the matrix of what holds (issue 20).

Run: ``python -m benchmarks.real_archs [--only qwen3,mamba] [--out PATH]``. The same
builders, rank bodies and tolerances as ``tests/models/test_real_archs.py``
(``tests/models/hf_archs.py``, ``tests/models/arch_bodies.py``): each architecture from a
tiny config (hidden 32, 2-4 blocks, vocab 128, 4 microbatches of 2 samples, seq 8,
eval mode), 2 gloo ranks spawned once per architecture, every check against the unsplit
model on the same batch:

    split N=2 / N=4     pipe(mb) == model(mb) for ps.pipeline(model, N) (balanced)
    ZBV / 1F1B          ZBVZeroBubble on 4 stages (V), 1F1B on 2, the model's own loss
                        (labels=): loss and every gradient, atol 1e-5
    AC full             ZBV, activation_checkpoint="full"
    AC selective        1F1B, activation_checkpoint=[the arch's block sub-modules]
    bf16                ZBV, mixed_precision=torch.bfloat16, against the unsplit model under
                        the same autocast: atol 1e-5 + rtol 1e-4
    loss_count          ZBV, per-item sum loss / the batch's valid items (- where no per-item loss)
    clip 2 / clip inf   ps.clip_grad_norm_ after the ZBV step against torch's on the unsplit model
    generate            causal LMs: pipe.generate (cut between blocks, 2 stages, one process)
                        against HF generate on the unsplit model, greedy, left-padded prompts:
                        ``ok`` (tokens equal, log-probabilities to 1e-5; then the decode program
                        that ran: ``eager``, the model's own modules, or ``traced``), ``refused`` (a recurrent
                        state, refused by name at generate's first line), else FAIL; ``-`` for the
                        other models (``tests/generate/archs.py``, as tests/generate runs it)

A cell is ``ok <max abs error>``, ``FAIL <max abs error>`` (a wrong result), or ``FAIL``
and the last line of the exception; failures are listed in full below the table.
``--out`` also writes the matrix as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

COLUMNS = {"split_2": "split N=2", "split_4": "split N=4", "ZBV": "ZBV", "1F1B": "1F1B", "ac_full": "AC full",
           "ac_selective": "AC selective", "bf16": "bf16", "loss_count": "loss_count", "clip_2": "clip 2",
           "clip_inf": "clip inf", "generate": "generate"}


def run(names: list[str]) -> dict[str, dict]:
    """``{arch: {check: {"ok", "err", "msg"}} | {"skipped": why} | {"crashed": text}}`` plus seconds."""
    from tests.generate import archs as gen_archs
    from tests.models import arch_bodies, hf_archs

    rows: dict[str, dict] = {}
    for name in names:
        why = hf_archs.missing(name)
        if why is not None:
            rows[name] = {"skipped": why}
            continue
        start = time.perf_counter()
        try:
            outcomes = arch_bodies.evaluate(name)
            rows[name] = {k: {"ok": o.ok, "err": o.err, "msg": o.msg, "cell": o.cell()} for k, o in outcomes.items()}
            if name in gen_archs.MATRIX:
                rows[name]["generate"] = _generation_cell(name)
        except Exception as e:  # a rank died or hung: the whole row
            rows[name] = {"crashed": f"{type(e).__name__}: {e}"}
        rows[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {rows[name]['seconds']} s", flush=True)
    return rows


def _generation_cell(name: str) -> dict:
    """The generate column's cell of a causal LM (see the module docstring)."""
    from tests.generate import archs as gen_archs

    verdict, detail = gen_archs.generation_check(name)
    expected = "refused" if name in gen_archs.RECURRENT else "equal"
    cell = {"equal": f"ok {detail}", "refused": "refused"}.get(verdict, f"FAIL {verdict}")
    return {"ok": verdict == expected, "err": None, "msg": detail, "cell": cell}


def render(rows: dict[str, dict]) -> None:
    table = Table(title="real architectures against the unsplit model (2 gloo ranks)")
    table.add_column("architecture")
    for col in COLUMNS.values():
        table.add_column(col)
    table.add_column("s", justify="right")
    for name, row in rows.items():
        if "skipped" in row or "crashed" in row:
            table.add_row(name, row.get("skipped") or row["crashed"][:80], *[""] * len(COLUMNS),
                          str(row.get("seconds", "")))
            continue
        cells = []
        for key in COLUMNS:
            cell = row[key]["cell"] if key in row else "-"
            cells.append(f"[red]{cell}[/red]" if key in row and not row[key]["ok"] else cell)
        table.add_row(name, *cells, str(row["seconds"]))
    console = Console(width=220)
    console.print(table)
    for name, row in rows.items():
        for key in COLUMNS:
            if key in row and not row[key]["ok"]:
                console.print(f"[bold]{name} / {COLUMNS[key]}[/bold]\n{row[key]['msg']}", markup=True,
                              highlight=False)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    from tests.models import hf_archs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated architectures (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="also write the matrix here as JSON")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(hf_archs.BUILDERS)
    unknown = sorted(set(names) - set(hf_archs.BUILDERS))
    if unknown:
        parser.error(f"unknown architectures {unknown}; known: {', '.join(hf_archs.BUILDERS)}")
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = run(names)
    render(rows)
    if args.out is not None:
        import transformers

        meta = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
