"""``llamaspec probe``: memory level and the "will speculation pay off" report."""
from __future__ import annotations

import json
import sys

import click
from rich.table import Table

from ._common import err_console, handle_errors, resolve_model_arg
from .device_options import device_options, pop_device_options


@click.command()
@click.argument("target", required=False)
@click.option("-md", "--draft-model", "draft", default=None, help="Draft model (name or path) to compare with the target.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (schema in docs/cli.md).")
@click.option("--no-bench", is_flag=True, help="Skip timings (checkpoint cost, verify-cost curve): levels and metadata only.")
@click.option("--n-rs-seq", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="Recurrent-state snapshots to request when checking whether RS is available.")
@click.option("--checkpoint-tokens", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Tokens in the sequence whose checkpoint is measured.")
@device_options()
@click.option("--cache-dir", default=None, help="Model cache directory.")
@handle_errors
def probe(target, draft, as_json, no_bench, n_rs_seq, checkpoint_tokens, cache_dir, **device_kw):
    """Probe TARGET (name or path; default model if omitted): rollback level and speculation costs."""
    from llamaspec import Model
    from llamaspec.probe import probe as run_probe

    dev = pop_device_options(device_kw)
    placement = {k: dev[k] for k in ("main_gpu", "split_mode", "tensor_split")}  # the draft shares the target's
    tpath = resolve_model_arg(target, cache_dir)
    dpath = resolve_model_arg(draft, cache_dir) if draft else None
    with Model(tpath, n_gpu_layers=dev["n_gpu_layers"], rpc_servers=dev["rpc_servers"], **placement) as tm:
        dm = (Model(dpath, n_gpu_layers=dev["n_gpu_layers_draft"], rpc_servers=dev["rpc_servers_draft"], **placement)
              if dpath else None)
        try:
            if not as_json:
                err_console.print(f"[dim]probing {tm.path.name}{' and ' + dm.path.name if dm else ''}...[/]")
            rep = run_probe(tm, dm, measure=not no_bench, n_rs_seq=n_rs_seq, n_threads=dev["n_threads"],
                            n_threads_batch=dev["n_threads_batch"], n_threads_draft=dev["n_threads_draft"],
                            checkpoint_tokens=checkpoint_tokens)
            rpc = _rpc_report(tm, dm)  # after the measurements: the servers' free memory with the models loaded
        finally:
            if dm is not None:
                dm.close()
    d = rep.to_dict()
    if rpc:
        d["rpc"] = rpc
    if as_json:
        sys.stdout.write(json.dumps(d, indent=2) + "\n")
        return
    render(d)


def _rpc_report(tm, dm) -> list[dict]:
    """One entry per RPC device the target / draft were loaded on: server, device, its memory (``--rpc``)."""
    out: list[dict] = []
    seen: dict[int, dict] = {}
    for role, m in (("target", tm), ("draft", dm)):
        for dev in (m.rpc_devices if m is not None else ()):
            if dev.ptr in seen:
                seen[dev.ptr]["models"].append(role)
                continue
            e = dev.as_dict()
            e["models"] = [role]
            seen[dev.ptr] = e
            out.append(e)
    return out


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def render(d: dict) -> None:
    from rich.console import Console

    con = Console()  # the human report goes to stdout (it is what was asked for)
    models = [("target", d["target"])] + ([("draft", d["draft"])] if "draft" in d else [])
    t = Table(title="Models", show_lines=False)
    t.add_column("")
    for role, _ in models:
        t.add_column(role)
    rows = [
        ("file", lambda m: m["path"].rsplit("/", 1)[-1]),
        ("arch", lambda m: m["arch"]),
        ("size", lambda m: _mb(m["file_bytes"])),
        ("params", lambda m: f"{m['n_params'] / 1e6:.1f} M"),
        ("n_ctx_train", lambda m: str(m["n_ctx_train"])),
        ("layers / embd / vocab", lambda m: f"{m['n_layer']} / {m['n_embd']} / {m['n_vocab']}"),
        ("SWA / recurrent / hybrid", lambda m: f"{'yes (' + str(m['n_swa']) + ')' if m['is_swa'] else 'no'} / "
                                               f"{'yes' if m['is_recurrent'] else 'no'} / {'yes' if m['is_hybrid'] else 'no'}"),
        ("rollback level", lambda m: f"[bold]{m['level']}[/]"),
        ("level with n_rs_seq", lambda m: f"{m['level_with_rs']} (n_rs_seq={m['n_rs_seq']})"),
        ("checkpoint (PARTIAL_ONLY)", lambda m: "-" if not m.get("checkpoint") else
            f"{_mb(m['checkpoint']['partial_bytes'])} at {m['checkpoint']['n_tokens']} tok; "
            f"save {m['checkpoint']['save_ms']:.2f} ms, load {m['checkpoint']['load_ms']:.2f} ms"),
        ("verify cost ms (1,2,4,8,16)", lambda m: "-" if not m.get("verify_cost_ms") else
            ", ".join(f"{v:.2f}" for v in m["verify_cost_ms"].values())),
    ]
    for label, f in rows:
        t.add_row(label, *[f(m) for _, m in models])
    con.print(t)
    if d.get("rpc"):
        rt = Table(title="RPC devices (the verify costs above include the network round trips)")
        for c in ("server", "device", "description", "free", "total", "holds"):
            rt.add_column(c)
        for e in d["rpc"]:
            rt.add_row(e["endpoint"], e["name"], e["description"], f"{e['memory_free'] / 2**20:.0f} MiB",
                       f"{e['memory_total'] / 2**20:.0f} MiB", ", ".join(e["models"]))
        con.print(rt)
    if d.get("heads"):
        ht = Table(title="Same-trunk draft heads (--spec-type)")
        for c in ("drafter", "runs", "why not / warning"):
            ht.add_column(c)
        for name, h in d["heads"].items():
            runs = ("[yellow]yes[/]" if h.get("warning") else "[green]yes[/]") if h.get("supported") else "[red]no[/]"
            ht.add_row(name, runs, h.get("why") or h.get("warning") or "")
        con.print(ht)
    if "draft" in d:
        v = d["vocab"]
        vt = Table(title=f"Vocabulary compatibility (llama.cpp's rules, docs/architecture.md §11): {'[green]compatible[/]' if v['compatible'] else '[red]incompatible[/]'}")
        vt.add_column("rule")
        vt.add_column("ok")
        vt.add_column("detail")
        for r in v["rules"]:
            vt.add_row(r["rule"], "[green]yes[/]" if r["ok"] else "[red]no[/]", r["detail"])
        con.print(vt)
        if d.get("cost_ratio") is not None:
            con.print(f"draft/target cost ratio (1 token): [bold]{d['cost_ratio']:.3f}[/]")
    if d["recommendations"]:
        rt = Table(title="Recommended draft length (n_max) by acceptance rate")
        rt.add_column("drafter")
        rt.add_column("cost ratio")
        for a in sorted({r["acceptance"] for r in d["recommendations"]}):
            rt.add_column(f"a={a}")
        by: dict = {}
        for r in d["recommendations"]:
            by.setdefault((r["drafter"], r["cost_ratio"]), []).append(r)
        for (kind, c), rs in by.items():
            rt.add_row(kind, f"{c:.3f}", *[("no" if r["n_max"] == 0 else f"{r['n_max']} (x{r['expected_speedup']:.2f})") for r in rs])
        con.print(rt)
        con.print("[dim]expected speedup = (1 - a^(k+1)) / ((1 - a)(k c + v)), v from the measured verify-cost curve[/]")
